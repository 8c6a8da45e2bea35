"""Re-dispatch of waiting prefill requests (:func:`router.policy.rebalance.plan_redispatch`):
hand-made states with the predicted TTFTs worked out by hand, a negative control per branch,
and the property that a plan never raises the total predicted TTFT."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.placement import Pool
from router.policy.base import Dispatched, RouteRequest
from router.policy.load_model import LoadModel
from router.policy.rebalance import (
    InstanceQueue,
    QueuedRequest,
    plan_redispatch,
    total_predicted_ttft,
)
from router.policy.registry import create_prefill_policy

LOAD = LoadModel(per_token_s=1e-3)  # 1 ms per token: 1,000 tokens = 1 s


def q(rid: str, tokens: int, **there: int) -> QueuedRequest:
    return QueuedRequest(rid, tokens, None, 0, there)


def test_hand_example_moves_while_the_total_predicted_ttft_falls() -> None:
    # s runs 1,000 tokens, then a (1,000) and b (500): TTFTs 2.0 and 2.5 s, total 4.5 s.
    # a costs 200 on the new instance n (it holds a's prefix), b 500.
    src = InstanceQueue("s", 1000, [q("a", 1000, n=200), q("b", 500, n=500)])
    moves = plan_redispatch([src], {"n": 0}, LOAD)
    # a first: on n at 0.2 s instead of 2.0, and b behind it 1.0 s sooner: -2.8 s
    # (b first would give -2.0 s); then b: on n behind a at 0.7 s instead of 1.5: -0.8 s
    assert [(m.request_id, m.source, m.target) for m in moves] == [("a", "s", "n"),
                                                                   ("b", "s", "n")]
    assert [m.delta_s for m in moves] == pytest.approx([-2.8, -0.8])


def test_a_move_that_does_not_lower_the_predicted_ttft_is_not_made() -> None:
    # a alone on s, nothing running: 1.0 s there; on n it would wait behind 0 and cost the
    # same 1,000 tokens (delta 0), on a busy target behind 5,000 (delta +5 s)
    assert plan_redispatch([InstanceQueue("s", 0, [q("a", 1000, n=1000)])], {"n": 0},
                           LOAD) == []
    assert plan_redispatch([InstanceQueue("s", 0, [q("a", 1000, n=1000)])], {"n": 5000},
                           LOAD) == []
    # control: the same request behind 1,000 running tokens moves (-1.0 s)
    moves = plan_redispatch([InstanceQueue("s", 1000, [q("a", 1000, n=1000)])], {"n": 0}, LOAD)
    assert [(m.request_id, m.delta_s) for m in moves] == [("a", pytest.approx(-1.0))]


def test_of_equal_gains_the_request_that_waited_longest_moves() -> None:
    # s runs 1,000 tokens, then a and b (1,000 each); n has 1,000 ahead: moving either saves
    # 1.0 s in total. a moves: it arrived first, so it is the nearest to its TTFT SLO.
    src = InstanceQueue("s", 1000, [q("a", 1000, n=1000), q("b", 1000, n=1000)])
    moves = plan_redispatch([src], {"n": 1000}, LOAD)
    assert [(m.request_id, m.delta_s) for m in moves] == [("a", pytest.approx(-1.0))]
    # control: a gain still rules: a costs more on n (-0.8 s), b moves (-1.0 s)
    src = InstanceQueue("s", 1000, [q("a", 1000, n=1200), q("b", 1000, n=1000)])
    moves = plan_redispatch([src], {"n": 1000}, LOAD)
    assert [(m.request_id, m.delta_s) for m in moves] == [("b", pytest.approx(-1.0))]


def test_running_work_never_moves() -> None:
    # 50 s of work running on s and nothing waiting: an idle target gets nothing
    assert plan_redispatch([InstanceQueue("s", 50_000, [])], {"n": 0}, LOAD) == []
    # control: one request waiting behind it moves, and only that one
    moves = plan_redispatch([InstanceQueue("s", 50_000, [q("w", 100, n=100)])], {"n": 0}, LOAD)
    assert [m.request_id for m in moves] == ["w"]


def test_no_target_no_move() -> None:
    busy = InstanceQueue("s", 10_000, [q(f"r{i}", 1000, n=1000) for i in range(5)])
    assert plan_redispatch([busy], {}, LOAD) == []
    # a request that names no cost on the target may not go there
    assert plan_redispatch([InstanceQueue("s", 10_000, [q("r", 1000)])], {"n": 0}, LOAD) == []
    # an instance is no target of its own queue
    assert plan_redispatch([InstanceQueue("s", 10_000, [q("r", 1000, s=1000)])], {"s": 0},
                           LOAD) == []
    # control: the same queue with a target moves
    assert plan_redispatch([busy], {"n": 0}, LOAD)


def test_each_request_moves_at_most_once_and_max_moves_holds() -> None:
    # two new instances, a long queue: every request could go to either
    queue = [q(f"r{i}", 1000, n1=1000, n2=1000) for i in range(10)]
    moves = plan_redispatch([InstanceQueue("s", 0, queue)], {"n1": 0, "n2": 0}, LOAD)
    ids = [m.request_id for m in moves]
    assert len(ids) == len(set(ids))
    assert {m.target for m in moves} == {"n1", "n2"}
    assert len(plan_redispatch([InstanceQueue("s", 0, queue)], {"n1": 0, "n2": 0}, LOAD,
                               max_moves=3)) == 3


def test_evacuation_moves_every_waiting_request_even_at_a_loss() -> None:
    # s is being removed: a and b leave even though n is busier (each goes where its
    # predicted TTFT is lowest: m is less loaded than n)
    src = InstanceQueue("s", 0, [q("a", 1000, n=1000, m=1000), q("b", 1000, n=1000, m=1000)])
    assert plan_redispatch([src], {"n": 9000, "m": 5000}, LOAD) == []  # control: no removal
    moves = plan_redispatch([src], {"n": 9000, "m": 5000}, LOAD, evacuate={"s"})
    assert sorted(m.request_id for m in moves) == ["a", "b"]
    assert [m.target for m in moves] == ["m", "m"]
    assert moves[0].delta_s > 0  # made at a loss
    # an instance being removed takes nothing itself
    other = InstanceQueue("o", 20_000, [q("c", 1000, s=1000)])
    assert plan_redispatch([other], {"s": 0}, LOAD, evacuate={"s"}) == []


@given(
    queues=st.lists(st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 4000),
                                       st.integers(0, 4000)), max_size=8), min_size=1,
                    max_size=3),
    ahead=st.lists(st.integers(0, 20_000), min_size=3, max_size=3),
    tails=st.tuples(st.integers(0, 30_000), st.integers(0, 30_000)),
)
@settings(max_examples=150, deadline=None)
def test_redispatch_never_raises_the_total_predicted_ttft(
        queues: list[list[tuple[int, int, int]]], ahead: list[int],
        tails: tuple[int, int]) -> None:
    sources = [InstanceQueue(f"s{i}", ahead[i],
                             [q(f"s{i}r{j}", t, t1=a, t2=b) for j, (t, a, b) in enumerate(qq)])
               for i, qq in enumerate(queues)]
    targets = {"t1": tails[0], "t2": tails[1]}
    moves = plan_redispatch(sources, targets, LOAD)
    moved = {m.request_id: m.target for m in moves}
    assert len(moved) == len(moves)
    assert all(m.delta_s < 0 for m in moves)
    before_q: dict[str, list[int]] = {s.worker_id: [r.tokens for r in s.queue] for s in sources}
    after_q: dict[str, list[int]] = {s.worker_id: [r.tokens for r in s.queue
                                                   if r.request_id not in moved]
                                     for s in sources}
    after_q["t1"], after_q["t2"] = [], []
    every = {r.request_id: r for s in sources for r in s.queue}
    for m in moves:
        after_q[m.target].append(every[m.request_id].target_tokens[m.target])
    ahead_map = {**{s.worker_id: s.ahead_tokens for s in sources}, **targets}
    before = total_predicted_ttft(before_q, ahead_map, LOAD)
    after = total_predicted_ttft(after_q, ahead_map, LOAD)
    assert after <= before + 1e-9
    assert after == pytest.approx(before + sum(m.delta_s for m in moves))


class _Ledger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None, int]] = []

    def start(self, worker_id: str, request_id: str | None = None, tokens: int = 0,
              *, prefill: bool = False) -> None:
        self.calls.append(("start", worker_id, request_id, tokens))

    def finish(self, worker_id: str, request_id: str | None = None) -> None:
        self.calls.append(("finish", worker_id, request_id, 0))


def test_placement_costs_a_target_by_the_policy_cache_estimate_and_moves_through_the_ledger(
        ) -> None:
    """``Pool.plan_redispatch`` prices each target with the policy's cache model: a request
    whose prefix the policy saw land on ``warm`` costs less there than on ``cold``."""
    policy = create_prefill_policy("dualmap")
    ledger = _Ledger()
    pool = Pool("prefill", policy, ledger)
    pool.sync("m", ["src", "warm", "cold"])
    hashes = tuple(range(1, 65))  # 64 blocks = 1,024 tokens
    seen = RouteRequest("seen", "m", block_hashes=hashes, num_prompt_tokens=1024)
    policy.observe(Dispatched("seen", "warm", "m", seen))
    r = RouteRequest("r", "m", block_hashes=(*hashes, 99), num_prompt_tokens=1040)
    assert pool.cached_tokens(r, "warm") == 1024 and pool.cached_tokens(r, "cold") == 0
    # equal tails: warm wins (16 uncached tokens vs 1,040)
    moves = pool.plan_redispatch([("src", 5000, [(r, 1040)])], {"warm": 300, "cold": 300},
                                 LOAD)
    assert [(m.request_id, m.target) for m in moves] == [("r", "warm")]
    assert moves[0].delta_s == pytest.approx((300 + 16 - 5000 - 1040) * 1e-3)
    # cold only, behind more than it saves: no move (negative control of the pricing)
    assert pool.plan_redispatch([("src", 500, [(r, 1040)])], {"cold": 600}, LOAD) == []
    ledger.calls.clear()
    assert pool.move(r, "src", "warm") == 16
    assert ledger.calls == [("finish", "src", "r", 0), ("start", "warm", "r", 16)]
