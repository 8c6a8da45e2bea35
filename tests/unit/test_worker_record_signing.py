"""Signed registrations (security review finding 4): a record is trusted only as written by a
holder of the cluster secret."""

from __future__ import annotations

import dataclasses

import pytest

from kvtransfer.signing import Keyring
from router.state.registry import WorkerRecord

RING = Keyring((b"cluster-secret-aaaaaaaaaaaaaaaaaaaaaaaa",))
OTHER = Keyring((b"another-secret-bbbbbbbbbbbbbbbbbbbbbbbb",))
RECORD = WorkerRecord("prefill-0", "prefill", "tiny", "/m", "http://10.0.0.5:8100", "engine-0",
                      "dWN4", 4096, 1_700_000_000.0, "tcp://10.0.0.5:5557")


def test_a_signed_record_verifies_and_survives_the_registry_round_trip() -> None:
    signed = RECORD.signed(RING)
    assert signed.signature and signed.verified(RING)
    assert WorkerRecord.from_json(signed.to_json()).verified(RING)
    # a rotating keyring (new secret first) still trusts what the old secret signed
    assert signed.verified(Keyring((*OTHER.secrets, *RING.secrets)))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(WorkerRecord)
                                   if f.name != "signature"])
def test_changing_any_field_voids_the_signature(field: str) -> None:
    signed = RECORD.signed(RING)
    value = getattr(signed, field)
    changed = ("decode" if field == "role" else value + 1 if isinstance(value, (int, float))
               else value + "x")
    assert not dataclasses.replace(signed, **{field: changed}).verified(RING)


def test_unsigned_and_foreign_records_are_not_trusted() -> None:
    assert not RECORD.verified(RING)
    assert not RECORD.signed(OTHER).verified(RING)
    assert not dataclasses.replace(RECORD, signature="0" * 64).verified(RING)
