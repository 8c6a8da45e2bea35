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
    release_message,
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


def test_release_message_round_trips() -> None:
    assert parse_release(release_message("cmpl-1-0")) == "cmpl-1-0"
    assert parse_release(b"hello") is None


def test_connector_config_rejects_unknown_and_bad_values() -> None:
    assert ConnectorConfig.from_extra_config({"lease_s": 5}).lease_s == 5
    with pytest.raises(ConfigError, match="allowed"):
        ConnectorConfig.from_extra_config({"lease": 5})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"lease_s": 0})
