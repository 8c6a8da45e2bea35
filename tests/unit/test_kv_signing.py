"""Signed kv_transfer_params: what verifies, what is refused, and key rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtransfer.signing import (
    SIGNATURE_KEY,
    TARGET_KEY,
    Keyring,
    KeyringFile,
    SeenSignatures,
    strip_signature,
    verify_for_engine,
)

OLD = "old-secret-0123456789abcdef-0123456789"
NEW = "new-secret-fedcba9876543210-9876543210"
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


def test_secrets_under_32_bytes_are_refused_with_the_reason() -> None:
    """Review finding 22: no secret under 32 bytes, in any line of a keyring; the error says how
    long it is and what is needed, never the secret. Controls: 32 bytes are taken, and 16 (the
    old minimum) are not."""
    with pytest.raises(ValueError, match="the cluster secret is 31 bytes; at least 32 are "
                                         "required") as short:
        Keyring.parse("q" * 31)
    assert "q" * 8 not in str(short.value)
    with pytest.raises(ValueError, match="is 16 bytes"):
        Keyring.parse("q" * 16)
    with pytest.raises(ValueError, match="secret 2 of 2 is 20 bytes"):
        Keyring.parse(f"{OLD}\n{'q' * 20}\n")
    assert Keyring.parse("q" * 32).secrets == (b"q" * 32,)
    assert len(OLD) >= 32 and Keyring.parse(f"{NEW}\n{OLD}").secrets == (NEW.encode(),
                                                                          OLD.encode())
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


def test_a_signature_is_for_one_engine_and_one_use() -> None:
    """Review finding 5: a leaked blob is refused on another engine and on a second use;
    controls: the same blob is accepted once by its own engine, and a fresh signature of the
    same params (what the router makes for each attempt) is accepted again."""
    ring = Keyring.parse(OLD)
    seen = SeenSignatures()
    blob = ring.sign(PARAMS, NOW, target="engine-a")
    assert verify_for_engine(ring, blob, NOW, "engine-b", SeenSignatures()).startswith(
        "signed for engine 'engine-a'")
    assert verify_for_engine(ring, blob, NOW, "engine-a", seen) is None
    assert verify_for_engine(ring, blob, NOW + 1, "engine-a", seen) == "replayed signature"
    again = ring.sign(PARAMS, NOW, target="engine-a")
    assert again[SIGNATURE_KEY]["n"] != blob[SIGNATURE_KEY]["n"]
    assert verify_for_engine(ring, again, NOW + 1, "engine-a", seen) is None
    untargeted = ring.sign(PARAMS, NOW)
    assert verify_for_engine(ring, untargeted, NOW, "engine-a", seen).startswith(
        "signed for engine None")
    moved = {**blob, TARGET_KEY: "engine-b"}  # the target is covered by the MAC
    assert verify_for_engine(ring, moved, NOW, "engine-b", SeenSignatures()) == "bad signature"
    assert strip_signature(blob) == PARAMS


def test_seen_signatures_are_forgotten_only_once_stale_or_full() -> None:
    seen = SeenSignatures(max_entries=3)
    assert seen.first_use("a", now=0.0, keep_s=10.0)
    assert not seen.first_use("a", now=9.0, keep_s=10.0)
    assert seen.first_use("a", now=10.5, keep_s=10.0)  # stale by now: it would not verify
    for mac in ("b", "c", "d"):
        assert seen.first_use(mac, now=11.0, keep_s=10.0)
    assert seen.first_use("a", now=11.0, keep_s=10.0)  # the oldest made room
