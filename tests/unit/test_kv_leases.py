"""Lease bookkeeping on the prefill side (time is an argument): one-shot, token-bound, capped."""

from __future__ import annotations

import pytest

from kvtransfer.leases import LeaseAnswer, LeaseTable

TOK = "secret-token-1"


def test_release_before_expiry_is_valid_and_frees() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    assert t.num_active == 1
    assert t.release("r1", TOK, now=5.0) is LeaseAnswer.HELD
    assert t.take_finished() == {"r1"}
    assert t.num_active == 0 and t.num_released == 1


def test_a_second_release_is_refused_once_the_blocks_may_be_reused() -> None:
    """Review finding 2: a decode that pulled and released, then failed, must not make a retry
    read the freed blocks as valid. The first release is ok (the control); the repeat is not."""
    t = LeaseTable()
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    assert t.release("r1", TOK, now=1.0) is LeaseAnswer.HELD
    assert t.take_finished() == {"r1"}  # the prefill frees the blocks now
    assert t.release("r1", TOK, now=2.0) is LeaseAnswer.ENDED
    assert t.num_refused == 1 and t.num_released == 1


def test_a_release_with_another_token_is_refused_and_leaves_the_lease_held() -> None:
    """Review finding 8: a peer that knows the id but not the token cannot end the lease."""
    t = LeaseTable()
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    assert t.release("r1", "forged", now=1.0) is LeaseAnswer.REFUSED
    assert t.num_active == 1 and t.take_finished() == set()
    assert t.release("r1", TOK, now=2.0) is LeaseAnswer.HELD  # the real decode still can


def test_expiry_frees_and_a_late_release_is_refused() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    assert t.expire(now=9.9) == []
    assert t.expire(now=10.0) == ["r1"]
    assert t.take_finished() == {"r1"}
    assert t.release("r1", TOK, now=11.0) is LeaseAnswer.ENDED
    assert t.take_finished() == set()
    assert t.num_expired == 1


def test_release_before_grant_finishes_at_grant_once() -> None:
    t = LeaseTable()
    assert t.release("r1", TOK, now=1.0) is LeaseAnswer.EARLY  # blocks cannot be freed before grant
    assert t.release("r1", TOK, now=1.5) is LeaseAnswer.REFUSED  # one-shot even before the grant
    assert t.take_finished() == set()
    t.grant("r1", expires_at=30.0, token=TOK, now=2.0)
    assert t.take_finished() == {"r1"}
    assert t.num_active == 0
    assert t.release("r1", TOK, now=3.0) is LeaseAnswer.ENDED


def test_an_early_release_with_another_token_does_not_end_the_lease() -> None:
    t = LeaseTable()
    assert t.release("r1", "forged", now=1.0) is LeaseAnswer.EARLY  # nothing to check it against
    t.grant("r1", expires_at=30.0, token=TOK, now=2.0)
    assert t.num_active == 1 and t.take_finished() == set()
    assert t.release("r1", TOK, now=3.0) is LeaseAnswer.HELD


def test_finished_ids_are_reported_once() -> None:
    t = LeaseTable()
    t.grant("a", 5.0, TOK, 0.0)
    t.grant("b", 50.0, TOK, 0.0)
    t.release("b", TOK, 1.0)
    t.expire(6.0)
    assert t.take_finished() == {"a", "b"}
    assert t.take_finished() == set()


def test_memory_of_ended_ids_is_bounded() -> None:
    """Ids are forgotten after ``memory_s`` (longer than a signature lives, so no validly
    signed params can still name them); an unknown id is then an early release again."""
    t = LeaseTable(memory_s=100.0)
    t.grant("old", 1.0, TOK, 0.0)
    t.expire(2.0)
    assert t.release("old", TOK, 50.0) is LeaseAnswer.ENDED  # remembered
    t.expire(500.0)  # forgets "old"
    assert t.release("old", TOK, 501.0) is LeaseAnswer.EARLY


def test_renewal_extends_only_a_held_lease_with_its_token() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    assert t.renew("r1", TOK, expires_at=25.0) is LeaseAnswer.HELD
    assert t.renew("r1", TOK, expires_at=12.0) is LeaseAnswer.HELD  # never shortened
    assert t.renew("r1", "forged", expires_at=39.0) is LeaseAnswer.REFUSED
    assert t.expire(now=20.0) == []  # without the renewal it would have expired at 10
    assert t.expire(now=25.0) == ["r1"]
    assert t.renew("r1", TOK, expires_at=40.0) is LeaseAnswer.ENDED  # gone: its pull fails
    assert t.renew("never-granted", TOK, expires_at=40.0) is LeaseAnswer.REFUSED
    assert t.num_renewed == 2


def test_renewals_never_outlive_the_life_cap() -> None:
    """Review finding 8: renewals alone cannot pin KV forever (cap: 4 x the first length)."""
    t = LeaseTable(life_factor=4.0)
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    for now in range(5, 100, 5):
        t.renew("r1", TOK, expires_at=now + 10.0)
        if t.expire(float(now)):
            break
    assert t.take_finished() == {"r1"}
    assert t.num_expired == 1
    assert now == 40  # the cap, though every renewal asked for 10 s more


def test_early_releases_are_bounded() -> None:
    """Review finding 15: made-up early releases cannot grow the prefill's memory."""
    t = LeaseTable(max_early=3)
    for i in range(10):
        assert t.release(f"made-up-{i}", TOK, now=float(i)) is LeaseAnswer.EARLY
    assert len(t._early) == 3
    t.grant("made-up-9", 30.0, TOK, 10.0)  # the newest is still remembered
    assert t.take_finished() == {"made-up-9"}
    # their timeline stamps too, while no engine step takes them
    assert [rid for rid, _ in t.take_released()] == ["made-up-7", "made-up-8", "made-up-9"]


def test_a_released_lease_is_stamped_before_its_blocks_can_be_freed() -> None:
    """The lease_released stamp of the timeline is kept with the release itself: the engine
    step that frees the blocks (``take_finished``) may be its last for a while, and it takes
    the stamps after the finished ids, so a stamp added after the release would be left
    behind (what `test_pd_timeline` caught). Only "ok" releases are stamped."""
    t = LeaseTable()
    t.grant("held", 30.0, TOK, 0.0)
    assert t.release("held", TOK, now=1.0, wall_s=101.0) is LeaseAnswer.HELD
    assert t.take_finished() == {"held"}
    assert t.take_released() == [("held", 101.0)]
    assert t.release("early", TOK, now=2.0, wall_s=102.0) is LeaseAnswer.EARLY
    # control: refused and repeated releases are not stamped
    assert t.release("held", TOK, now=3.0, wall_s=103.0) is LeaseAnswer.ENDED
    assert t.release("early", TOK, now=3.0, wall_s=103.0) is LeaseAnswer.REFUSED
    assert t.take_released() == [("early", 102.0)]
    assert t.take_released() == []


@pytest.mark.parametrize(("answer", "ok", "vouched"), [
    (LeaseAnswer.HELD, True, True),
    (LeaseAnswer.EARLY, True, False),
    (LeaseAnswer.ENDED, False, True),
    (LeaseAnswer.REFUSED, False, False),
])
def test_answers_say_what_to_reply_and_whether_the_requester_proved_a_lease(
        answer: LeaseAnswer, ok: bool, vouched: bool) -> None:
    """Review finding 15: only a requester that echoed a granted lease's token (held or ended)
    is vouched for, so only it may make the prefill's transport connect to it; an early
    release is answered "ok" but proves nothing (anyone can make one up)."""
    assert (answer.ok, answer.vouched) == (ok, vouched)


def test_a_release_is_vouched_only_by_the_token_of_a_granted_lease() -> None:
    t = LeaseTable()
    t.grant("r1", expires_at=10.0, token=TOK, now=0.0)
    t.grant("r2", expires_at=5.0, token=TOK, now=0.0)
    assert not t.release("made-up", TOK, now=1.0).vouched
    assert not t.release("r1", "forged", now=1.0).vouched
    assert not t.renew("r1", "forged", expires_at=12.0).vouched
    assert t.renew("r1", TOK, expires_at=12.0).vouched
    assert t.release("r1", TOK, now=2.0).vouched
    assert t.release("r1", TOK, now=3.0).vouched  # a repeat by the holder: "expired", vouched
    assert not t.release("r1", "forged", now=3.0).vouched
    assert t.expire(now=6.0) == ["r2"]
    assert t.release("r2", TOK, now=7.0) is LeaseAnswer.ENDED  # expired: the holder is known
    assert t.renew("r2", TOK, expires_at=20.0) is LeaseAnswer.ENDED
    assert t.renew("r2", "forged", expires_at=20.0) is LeaseAnswer.REFUSED


def test_an_answer_is_not_a_bool() -> None:
    """Every enum member is truthy, so `if table.release(...)` would take every release as
    valid: using an answer as a bool raises instead."""
    with pytest.raises(TypeError, match="LeaseAnswer.ok"):
        bool(LeaseTable().release("r1", TOK, now=1.0))
