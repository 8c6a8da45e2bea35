"""Policy factories: the context gives defaults, a policy's own parameters override them, and
unknown parameters are refused by the policy's factory."""

from __future__ import annotations

import pytest

from router.errors import ConfigError
from router.placement import Placement
from router.policy.base import Candidate, Membership, RouteRequest
from router.policy.context import PolicyContext
from router.policy.registry import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    create_decode_policy,
    create_prefill_policy,
)
from router.state.load import LoadTracker

CTX = PolicyContext(ttft_slo_s=2.0, per_token_s=3e-4, block_tokens=32,
                    cache_capacity_blocks=1000)


def test_dualmap_takes_the_context_and_its_own_overrides() -> None:
    policy = create_prefill_policy("dualmap", CTX)
    cfg = policy.config  # type: ignore[attr-defined]
    assert (cfg.ttft_slo_s, cfg.per_token_s, cfg.block_tokens, cfg.cache_capacity_blocks) == (
        2.0, 3e-4, 32, 1000)
    tuned = create_prefill_policy("dualmap", CTX, switch_fraction=1.0, ttft_slo_s=4.0)
    assert tuned.config.switch_fraction == 1.0  # type: ignore[attr-defined]
    assert tuned.config.ttft_slo_s == 4.0  # type: ignore[attr-defined]


def test_prefix_models_use_the_context_cache_geometry() -> None:
    assert create_prefill_policy("prefix_only", CTX).block_tokens == 32  # type: ignore[attr-defined]
    assert create_prefill_policy("consistent_hash", CTX).block_tokens == 32  # type: ignore[attr-defined]
    assert create_decode_policy("kv_aware", CTX, max_running=4).max_running == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(("table", "name"), [
    *((PREFILL_POLICIES, n) for n in PREFILL_POLICIES),
    *((DECODE_POLICIES, n) for n in DECODE_POLICIES)])
def test_unknown_parameters_are_refused(table: object, name: str) -> None:
    create = create_prefill_policy if table is PREFILL_POLICIES else create_decode_policy
    assert create(name, CTX).name == name
    with pytest.raises(ConfigError, match="no parameter bogus"):
        create(name, CTX, bogus=1)


def test_placement_tells_membership_once_and_books_uncached_tokens() -> None:
    tracker = LoadTracker()
    placement = Placement.create("dualmap", "kv_aware", CTX, tracker)
    pool = placement.pool("prefill")
    heard: list[Membership] = []
    pool.observers = (lambda e: heard.append(e) if isinstance(e, Membership) else None,)
    assert pool.sync("m", ["b", "a"]) and not pool.sync("m", ["a", "b"])
    assert heard == [Membership("m", ("a", "b"))]
    route = RouteRequest("r1", "m", block_hashes=(1, 2, 3), num_prompt_tokens=96)
    choice = pool.choose(route, [Candidate("a"), Candidate("b")])
    assert choice is not None and choice.reason == "load" and choice.alternate is not None
    assert pool.begin(route, choice.worker) == 96
    assert tracker.pending_tokens(choice.worker) == 96
    again = RouteRequest("r2", "m", block_hashes=(1, 2, 3), num_prompt_tokens=96)
    # the whole prompt is now cached there (3 blocks x 32 tokens)
    assert pool.begin(again, choice.worker) == 0
    pool.end(route, choice.worker)
    assert tracker.pending_tokens(choice.worker) == 0 and tracker.in_flight(choice.worker) == 1
