"""Signed kv_transfer_params: what verifies, what is refused, and key rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtransfer.signing import SIGNATURE_KEY, Keyring, KeyringFile, strip_signature

OLD = "old-secret-0123456789abcdef"
NEW = "new-secret-fedcba9876543210"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_request_id": "r1",
          "remote_block_ids": [3, 4, 5], "remote_handshake": "aGVsbG8=", "remote_num_tokens": 40,
          "lease_s": 30.0}
NOW = 1_800_000_000.0


def test_signed_params_verify_and_keep_every_field() -> None:
    ring = Keyring.parse(OLD)
    signed = ring.sign(PARAMS, NOW)
    assert strip_signature(signed) == PARAMS
    assert ring.verify(signed, NOW + 1.0) is None


@pytest.mark.parametrize(("field", "value"), [
    ("remote_block_ids", [3, 4, 6]), ("remote_handshake", "Zm9yZ2Vk"),
    ("remote_engine_id", "e2"), ("do_remote_decode", True), ("remote_num_tokens", 41)])
def test_any_change_breaks_the_signature(field: str, value: object) -> None:
    ring = Keyring.parse(OLD)
    forged = {**ring.sign(PARAMS, NOW), field: value}
    assert ring.verify(forged, NOW) == "bad signature"


def test_unsigned_malformed_stale_and_future_are_refused() -> None:
    ring = Keyring.parse(OLD)
    signed = ring.sign(PARAMS, NOW)
    assert ring.verify(PARAMS, NOW) == "unsigned"
    assert ring.verify({**PARAMS, SIGNATURE_KEY: "x"}, NOW) == "unsigned"
    assert ring.verify({**PARAMS, SIGNATURE_KEY: {"k": 1, "t": NOW, "m": "x"}}, NOW) == \
        "malformed signature"
    assert ring.verify(signed, NOW + 121.0, max_age_s=120.0).startswith("stale")
    assert ring.verify(signed, NOW - 121.0, max_age_s=120.0).startswith("stale")
    assert ring.verify(signed, NOW + 119.0, max_age_s=120.0) is None


def test_other_secret_is_refused() -> None:
    assert Keyring.parse(NEW).verify(Keyring.parse(OLD).sign(PARAMS, NOW), NOW) == \
        "bad signature"


def test_rotation_new_key_signs_both_verify() -> None:
    during = Keyring.parse(f"{NEW}\n{OLD}\n")
    assert during.verify(Keyring.parse(OLD).sign(PARAMS, NOW), NOW) is None
    signed = during.sign(PARAMS, NOW)
    assert Keyring.parse(f"# comment\n\n{OLD}\n{NEW}").verify(signed, NOW) is None
    assert Keyring.parse(OLD).verify(signed, NOW) == "bad signature"
    assert during.key_ids == (Keyring.parse(NEW).key_ids[0], Keyring.parse(OLD).key_ids[0])


def test_secrets_must_be_long_enough() -> None:
    with pytest.raises(ValueError):
        Keyring.parse("short")
    with pytest.raises(ValueError):
        Keyring.parse("# only a comment\n")


def test_keyring_file_reloads_on_change_and_survives_a_broken_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "keyring"
    path.write_text(OLD + "\n")
    source = KeyringFile(str(path))
    assert source.current().secrets == (OLD.encode(),)
    path.write_text(f"{NEW}\n{OLD}\n")
    os.utime(path, ns=(1, 2_000_000_000_000_000_000))  # a distinct mtime even on coarse clocks
    assert source.current().secrets == (NEW.encode(), OLD.encode())
    path.write_text("")
    os.utime(path, ns=(1, 3_000_000_000_000_000_000))
    assert source.current().secrets == (NEW.encode(), OLD.encode())
    with pytest.raises(ValueError):
        KeyringFile(str(tmp_path / "missing"))
