"""Handshake and kv_transfer_params wire formats."""

from __future__ import annotations

import pytest

from kvtransfer.config import ConnectorConfig
from kvtransfer.errors import ConfigError, HandshakeError
from kvtransfer.protocol import (
    Handshake,
    RegionSpec,
    RemotePrefill,
    compat_hash,
    parse_release,
    parse_renew,
    release_message,
    renew_message,
)

HS = Handshake("eng-1", b"\x00\x01ucx-address",
               (RegionSpec("l0#0", 4096, 65536, 65536, 10, b"rk"),),
               compat_hash(model="m", layers=4), b"\x07locality")


def test_handshake_round_trips() -> None:
    assert Handshake.from_wire(HS.to_wire()) == HS


@pytest.mark.parametrize("wire", ["", "not base64!", "e30=", HS.to_wire()[:-8]])
def test_malformed_handshake_is_a_handshake_error(wire: str) -> None:
    with pytest.raises(HandshakeError):
        Handshake.from_wire(wire)


def test_compat_hash_depends_on_every_fact() -> None:
    assert compat_hash(a=1, b=2) == compat_hash(b=2, a=1)
    assert compat_hash(a=1, b=2) != compat_hash(a=1, b=3)


def test_remote_prefill_requires_every_field() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
              "remote_block_ids": [3, 4], "remote_handshake": HS.to_wire()}
    parsed = RemotePrefill.from_params(params)
    assert parsed is not None and parsed.block_ids == (3, 4)
    assert RemotePrefill.from_params({**params, "do_remote_prefill": False}) is None
    assert RemotePrefill.from_params({k: v for k, v in params.items()
                                      if k != "remote_block_ids"}) is None
    assert RemotePrefill.from_params(None) is None


def test_release_and_renew_messages_carry_the_lease_token() -> None:
    assert parse_release(release_message("cmpl-1 0", "tok")) == ("cmpl-1 0", "tok")
    assert parse_renew(renew_message("cmpl-1-0", "tok")) == ("cmpl-1-0", "tok")
    assert parse_release(b"hello") is None
    assert parse_release(b"done cmpl-1-0") is None  # no token: not a release at all
    assert parse_renew(release_message("cmpl-1-0", "tok")) is None
    with pytest.raises(ValueError):
        release_message("cmpl-1-0", "")


def test_the_lease_token_travels_in_the_params() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
              "remote_block_ids": [1], "remote_handshake": HS.to_wire(),
              "remote_lease_token": "tok"}
    parsed = RemotePrefill.from_params(params)
    assert parsed is not None and parsed.lease_token == "tok"
    old = RemotePrefill.from_params({k: v for k, v in params.items()
                                     if k != "remote_lease_token"})
    assert old is not None and old.lease_token == ""  # a pull without one refuses to start


def test_connector_config_rejects_unknown_and_bad_values() -> None:
    assert ConnectorConfig.from_extra_config({"lease_s": 5}).lease_s == 5
    with pytest.raises(ConfigError, match="allowed"):
        ConnectorConfig.from_extra_config({"lease": 5})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"lease_s": 0})
