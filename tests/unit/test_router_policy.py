"""Placement policies: determinism, least-loaded choice, cool-down, purity."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.errors import ConfigError
from router.policy.base import Candidate, Dispatched, Finished, PlacementPolicy, RouteRequest
from router.policy.least_loaded import LeastLoadedPolicy
from router.policy.registry import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    create_decode_policy,
    create_prefill_policy,
)
from router.policy.round_robin import RoundRobinPolicy

REQ = RouteRequest(request_id="r", model="m")


def _run(
    policy: PlacementPolicy, candidates: list[Candidate], n: int, model: str = "m"
) -> list[str]:
    picks = []
    for i in range(n):
        req = RouteRequest(request_id=f"r{i}", model=model)
        choice = policy.select(req, candidates)
        assert choice is not None
        policy.observe(Dispatched(req.request_id, choice.worker_id, model))
        picks.append(choice.worker_id)
    return picks


def test_round_robin_cycles_in_worker_id_order() -> None:
    cands = [Candidate("p2"), Candidate("p0"), Candidate("p1")]
    assert _run(RoundRobinPolicy(), cands, 7) == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]


def test_round_robin_is_deterministic_across_instances() -> None:
    cands = [Candidate(f"w{i}") for i in range(5)]
    assert _run(RoundRobinPolicy(), cands, 13) == _run(RoundRobinPolicy(), cands, 13)


def test_round_robin_select_does_not_mutate() -> None:
    policy = RoundRobinPolicy()
    cands = [Candidate("a"), Candidate("b")]
    assert [policy.select(REQ, cands) for _ in range(3)] == [Candidate("a")] * 3


def test_round_robin_survives_membership_change() -> None:
    policy = RoundRobinPolicy()
    assert _run(policy, [Candidate("a"), Candidate("b"), Candidate("c")], 2) == ["a", "b"]
    # b left, d joined: continue after b in id order
    assert _run(policy, [Candidate("a"), Candidate("c"), Candidate("d")], 4) == [
        "c", "d", "a", "c"]


def test_round_robin_rotation_is_per_model() -> None:
    policy = RoundRobinPolicy()
    cands = [Candidate("a"), Candidate("b")]
    assert _run(policy, cands, 1, model="m1") == ["a"]
    assert _run(policy, cands, 1, model="m2") == ["a"]
    assert _run(policy, cands, 1, model="m1") == ["b"]


def test_round_robin_skips_recently_failed_unless_all_failed() -> None:
    policy = RoundRobinPolicy()
    cands = [Candidate("a", recently_failed=True), Candidate("b")]
    assert _run(policy, cands, 3) == ["b", "b", "b"]
    all_failed = [Candidate("a", recently_failed=True), Candidate("b", recently_failed=True)]
    assert _run(RoundRobinPolicy(), all_failed, 2) == ["a", "b"]


@pytest.mark.parametrize("factory", [RoundRobinPolicy, LeastLoadedPolicy])
def test_no_candidate_is_none(factory: type[PlacementPolicy]) -> None:
    assert factory().select(REQ, []) is None


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ({"d0": 3, "d1": 1, "d2": 2}, "d1"),
        ({"d0": 0, "d1": 5}, "d0"),
        ({"d0": 4, "d1": 4, "d2": 0}, "d2"),
        ({"d0": 2, "d1": 1, "d2": 1}, "d1"),  # tie: lowest id first when nothing dispatched yet
    ],
)
def test_least_loaded_picks_fewest_in_flight(loads: dict[str, int], expected: str) -> None:
    cands = [Candidate(w, in_flight=n) for w, n in loads.items()]
    choice = LeastLoadedPolicy().select(REQ, cands)
    assert choice is not None and choice.worker_id == expected


def test_least_loaded_rotates_ties() -> None:
    cands = [Candidate("d0"), Candidate("d1"), Candidate("d2")]
    assert _run(LeastLoadedPolicy(), cands, 4) == ["d0", "d1", "d2", "d0"]


def test_least_loaded_prefers_healthy_over_idle_failed() -> None:
    cands = [Candidate("d0", in_flight=0, recently_failed=True), Candidate("d1", in_flight=9)]
    choice = LeastLoadedPolicy().select(REQ, cands)
    assert choice is not None and choice.worker_id == "d1"


def test_finished_events_are_accepted() -> None:
    policy = LeastLoadedPolicy()
    policy.observe(Finished("r", "d0", "m", ok=False))
    assert policy.select(REQ, [Candidate("d0")]) == Candidate("d0")


def test_registry_names_and_unknown_name() -> None:
    assert {"round_robin"} <= set(PREFILL_POLICIES)
    assert {"least_loaded"} <= set(DECODE_POLICIES)
    assert create_prefill_policy("round_robin").name == "round_robin"
    assert create_decode_policy("least_loaded").name == "least_loaded"
    for name in PREFILL_POLICIES:
        assert isinstance(create_prefill_policy(name), PlacementPolicy)
    with pytest.raises(ConfigError,
                       match="allowed: aibrix_prefix, bounded_load_hash, consistent_hash, dualmap"):
        create_prefill_policy("nope")


FORBIDDEN_MODULES = {"asyncio", "httpx", "redis", "fastapi", "starlette", "time", "random",
                     "datetime", "uvicorn", "socket", "threading"}


PURE_MODULES = {
    # files -> the packages of ours they may import
    "router/policy/*.py": ("router.policy", "router.errors"),
    "router/policy/peers/*.py": ("router.policy", "router.errors"),
    "router/placement.py": ("router.policy",),
    "router/autoscale/planner.py": ("router.autoscale", "router.errors"),
    "router/autoscale/predictors.py": ("router.autoscale", "router.errors"),
    "router/autoscale/capacity.py": ("router.autoscale", "router.errors"),
    "router/autoscale/profile.py": ("router.autoscale", "router.errors"),
    "router/autoscale/signals.py": ("router.autoscale", "router.errors", "router.samples"),
    "router/autoscale/threshold.py": ("router.autoscale", "router.errors"),
    "router/samples.py": (),
}


@pytest.mark.parametrize("pattern", sorted(PURE_MODULES))
def test_pure_modules_do_no_io(pattern: str) -> None:
    """Policies and the planner take time and state as arguments: no clock, randomness,
    network, Redis or web framework, and only pure modules of ours."""
    files = sorted((Path(__file__).resolve().parents[2]).glob(pattern))
    assert files, f"no module matches {pattern}"
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN_MODULES, f"{path.name} imports {name}"
                if top == "router":
                    assert name.startswith(PURE_MODULES[pattern]), (
                        f"{path.name} imports {name} (allowed: {PURE_MODULES[pattern]})")


@given(ids=st.sets(st.text(min_size=1, max_size=6), min_size=1, max_size=8),
       rounds=st.integers(min_value=1, max_value=4))
def test_round_robin_is_fair(ids: set[str], rounds: int) -> None:
    cands = [Candidate(w) for w in ids]
    picks = _run(RoundRobinPolicy(), cands, rounds * len(ids))
    assert Counter(picks) == {w: rounds for w in ids}


@given(loads=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=10))
def test_least_loaded_never_picks_a_busier_worker(loads: list[int]) -> None:
    cands = [Candidate(f"d{i}", in_flight=n) for i, n in enumerate(loads)]
    choice = LeastLoadedPolicy().select(REQ, cands)
    assert choice is not None and choice.in_flight == min(loads)
