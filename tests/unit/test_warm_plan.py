"""The warm plan (``router.policy.warm.plan_warm``), pure: which prefixes a joining worker is
warmed with, on hand-made states. Each rule has a control that differs in the one fact it
reads."""

from __future__ import annotations

from collections.abc import Sequence

from router.policy.base import RouteRequest
from router.policy.hashing import block_hashes
from router.policy.warm import WarmPrefix, plan_warm

B = 4
"""Tokens per block in these states."""


def req(name: str, ids: Sequence[int]) -> RouteRequest:
    return RouteRequest(request_id=name, model="m", prompt_token_ids=tuple(ids),
                        block_hashes=block_hashes(ids, B))


SYSTEM = list(range(100, 108))  # two blocks every "chat" request starts with
A = req("a", [*SYSTEM, 1, 2, 3, 4])
C = req("c", [*SYSTEM, 5, 6, 7, 8])
OTHER = req("o", [9] * 12)


def plan(recent: list[RouteRequest], *, goes: dict[str, str], peer: dict[str, int],
         target_has: dict[str, int] | None = None, budget: int = 100
         ) -> list[tuple[str, int, int]]:
    """The plan for target "new": (request, blocks, new blocks), newest first."""
    plans = plan_warm(recent, lambda r: goes.get(r.request_id), lambda w: w == "new",
                      lambda r, w: (target_has or {}).get(r.request_id, 0),
                      lambda r, w: peer.get(r.request_id, 0), lambda r: r.block_hashes, budget)
    assert set(plans) <= {"new"}
    return [(p.route.request_id, p.blocks, p.new_blocks) for p in plans.get("new", [])]


def test_warms_what_placement_sends_the_target_and_a_peer_caches_newest_first() -> None:
    assert plan([A, C], goes={"a": "new", "c": "new"}, peer={"a": 3, "c": 3}) == [
        ("c", 3, 3), ("a", 3, 1)]  # the shared system prompt is warmed once


def test_not_what_placement_sends_elsewhere() -> None:
    assert plan([A, C], goes={"a": "new", "c": "old"}, peer={"a": 3, "c": 3}) == [("a", 3, 3)]
    assert plan([A, C], goes={}, peer={"a": 3, "c": 3}) == []  # control: nothing comes here


def test_only_as_far_as_a_peer_caches() -> None:
    assert plan([A], goes={"a": "new"}, peer={"a": 2}) == [("a", 2, 2)]
    assert plan([A], goes={"a": "new"}, peer={}) == []  # control: no peer caches it


def test_not_what_the_target_caches_already() -> None:
    assert plan([A], goes={"a": "new"}, peer={"a": 3}, target_has={"a": 3}) == []
    assert plan([A], goes={"a": "new"}, peer={"a": 3}, target_has={"a": 1}) == [("a", 3, 2)]


def test_the_budget_stops_the_plan_after_the_entry_that_crosses_it() -> None:
    recent = [OTHER, A, C]
    both = {"a": "new", "c": "new", "o": "new"}
    assert plan(recent, goes=both, peer={"a": 3, "c": 3, "o": 3}, budget=3) == [("c", 3, 3)]
    assert plan(recent, goes=both, peer={"a": 3, "c": 3, "o": 3}, budget=4) == [
        ("c", 3, 3), ("a", 3, 1)]  # control: one block more
    assert plan(recent, goes=both, peer={"a": 3, "c": 3, "o": 3}, budget=5) == [
        ("c", 3, 3), ("a", 3, 1), ("o", 3, 3)]


def test_other_targets_are_planned_apart() -> None:
    plans = plan_warm([A, C], lambda r: {"a": "n1", "c": "n2"}[r.request_id],
                      lambda w: True, lambda r, w: 0, lambda r, w: 3,
                      lambda r: r.block_hashes, 100)
    assert plans == {"n2": [WarmPrefix(C, 3, 3)], "n1": [WarmPrefix(A, 3, 3)]}
