"""Per-key token-rate limits (security review row 13): the token buckets of
``router.api.token_budget``, on a hand-driven clock (no sleeps)."""

from __future__ import annotations

import pytest

from router.api.token_budget import Charge, Refusal, TokenBucket, TokenBudgets, settled_output


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_bucket_refills_at_its_rate_per_minute() -> None:
    b = TokenBucket.full(60, 0.0)  # 1 token a second
    b.take(50, 0.0)
    assert b.level == 10
    assert b.wait_s(30, 0.0) == 20.0  # 20 tokens short at 1 per second
    assert b.wait_s(30, 5.0) == 15.0
    assert b.wait_s(30, 20.0) == 0.0 and b.level == 30


def test_the_burst_is_one_minutes_worth() -> None:
    b = TokenBucket.full(60, 0.0)
    assert b.wait_s(1, 3600.0) == 0.0 and b.level == 60  # idle an hour: still one minute's
    b.take(60, 3600.0)  # all of it at once
    assert b.wait_s(1, 3600.0) == 1.0


def test_a_request_larger_than_a_minute_waits_for_a_full_bucket_then_leaves_debt() -> None:
    b = TokenBucket.full(60, 0.0)
    b.take(10, 0.0)
    assert b.wait_s(100, 0.0) == 10.0  # needs a full bucket (60), not 100 it can never hold
    assert b.wait_s(100, 10.0) == 0.0
    b.take(100, 10.0)
    assert b.level == -40
    assert b.wait_s(1, 10.0) == 41.0  # the debt is paid before anything else passes


def test_give_back_settles_and_never_passes_capacity() -> None:
    b = TokenBucket.full(1000, 0.0)
    b.take(100, 0.0)
    b.give_back(90, 0.0)  # charged 100, used 10
    assert b.level == 990
    b.give_back(500, 0.0)
    assert b.level == 1000
    b.give_back(-100, 0.0)  # used 100 more than charged
    assert b.level == 900


@pytest.mark.parametrize(("charged", "reported", "events", "ok", "expected"), [
    (100, 7, 3, True, 7),        # the worker's usage wins
    (100, 7, 3, False, 7),
    (100, None, 3, True, 100),   # a stream without usage: the cap stays charged
    (100, None, 150, True, 150),  # ... or what it was seen to relay, if more (no cap set)
    (100, None, 3, False, 3),    # failed: what the client got
    (100, None, 0, False, 0),    # failed before any output: refunded
])
def test_settled_output(charged: int, reported: int | None, events: int, ok: bool,
                        expected: int) -> None:
    assert settled_output(charged, reported, events, ok) == expected


def test_keys_have_their_own_budgets_and_a_refusal_charges_nothing() -> None:
    clock = Clock()
    budgets = TokenBudgets(prefill_per_min=600, decode_per_min=120, clock=clock)
    assert budgets.enabled
    first = budgets.admit("a", 500, 100)
    assert first == Charge("a", 500, 100)
    refused = budgets.admit("a", 50, 100)  # prefill fits (100 left), decode does not (20)
    assert refused == Refusal("decode_tokens", 120, 100, 40)  # 80 short at 2 per second
    assert budgets.level("a", "prefill_tokens") == 100  # nothing charged
    assert budgets.admit("b", 500, 100) == Charge("b", 500, 100)  # another key: served
    # both short (prefill 300 at 10 a second: 30 s; decode 100 at 2 a second: 50 s)
    assert budgets.admit("a", 400, 120) == Refusal("decode_tokens", 120, 120, 50)
    clock.t += 40  # prefill 500, decode 100
    assert isinstance(budgets.admit("a", 50, 100), Charge)  # refilled


def test_the_longest_wait_wins_and_retry_after_rounds_up() -> None:
    clock = Clock()
    budgets = TokenBudgets(prefill_per_min=600, decode_per_min=120, clock=clock)
    budgets.admit("a", 600, 120)
    refused = budgets.admit("a", 100, 1)  # prefill: 10 s; decode: 0.5 s
    assert refused == Refusal("prefill_tokens", 600, 100, 10)
    clock.t += 9.5
    refused = budgets.admit("a", 100, 1)
    assert isinstance(refused, Refusal) and refused.retry_after_s == 1  # 0.5 s, rounded up


def test_settling_returns_unused_output_tokens() -> None:
    clock = Clock()
    budgets = TokenBudgets(prefill_per_min=0, decode_per_min=100, clock=clock)
    charge = budgets.admit("a", 10_000, 100)  # prefill unlimited: never refused, not charged
    assert charge == Charge("a", 0, 100)
    assert isinstance(budgets.admit("a", 0, 1), Refusal)
    budgets.settle(charge, 6)
    assert budgets.level("a", "decode_tokens") == 94
    assert budgets.admit("a", 0, 94) == Charge("a", 0, 94)


def test_no_rates_no_limits() -> None:
    budgets = TokenBudgets(0, 0, Clock())
    assert not budgets.enabled
    assert all(isinstance(budgets.admit("a", 10**9, 10**9), Charge) for _ in range(3))
    with pytest.raises(ValueError):
        TokenBudgets(-1, 0, Clock())
