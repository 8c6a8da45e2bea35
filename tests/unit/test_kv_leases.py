"""Lease bookkeeping on the prefill side (time is an argument)."""

from __future__ import annotations

from kvtransfer.leases import LeaseTable


def test_release_before_expiry_is_valid_and_frees() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0)
    assert t.num_active == 1
    assert t.release("r1", now=5.0) is True
    assert t.take_finished() == {"r1"}
    assert t.num_active == 0 and t.num_released == 1


def test_expiry_frees_and_a_late_release_is_refused() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0)
    assert t.expire(now=9.9) == []
    assert t.expire(now=10.0) == ["r1"]
    assert t.take_finished() == {"r1"}
    assert t.release("r1", now=11.0) is False
    assert t.take_finished() == set()
    assert t.num_expired == 1


def test_release_before_grant_finishes_at_grant() -> None:
    t = LeaseTable()
    assert t.release("r1", now=1.0) is True  # blocks cannot have been freed before the grant
    assert t.take_finished() == set()
    t.grant("r1", expires_at=30.0)
    assert t.take_finished() == {"r1"}
    assert t.num_active == 0


def test_finished_ids_are_reported_once() -> None:
    t = LeaseTable()
    t.grant("a", 5.0)
    t.grant("b", 50.0)
    t.release("b", 1.0)
    t.expire(6.0)
    assert t.take_finished() == {"a", "b"}
    assert t.take_finished() == set()


def test_memory_of_expired_ids_is_bounded() -> None:
    t = LeaseTable(memory_s=100.0)
    t.grant("old", 1.0)
    t.expire(2.0)
    t.expire(500.0)  # forgets "old"
    assert t.release("old", 501.0) is True  # unknown again: treated as an early release


def test_renewal_extends_only_a_held_lease() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0)
    assert t.renew("r1", expires_at=25.0) is True
    assert t.renew("r1", expires_at=12.0) is True  # never shortened
    assert t.expire(now=20.0) == []  # without the renewal it would have expired at 10
    assert t.expire(now=25.0) == ["r1"]
    assert t.renew("r1", expires_at=40.0) is False  # gone: its pull will fail and recompute
    assert t.renew("never-granted", expires_at=40.0) is False
    assert t.num_renewed == 2
