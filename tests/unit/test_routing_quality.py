"""bench.routing_quality: every registered policy is measured on every shape, and the ratio is
DualMap over the best of the others."""

from __future__ import annotations

import statistics

import pytest

from bench.routing_quality import (
    SHAPES,
    TUNED,
    TUNED_SEEDS,
    held_out,
    main,
    one,
    shape_requests,
)
from bench.sim.sweep import SweepConfig, reuse_ceiling
from bench.sim.workload import SimRequest, WorkloadConfig
from router.policy.registry import PREFILL_POLICIES


def test_one_row_measures_every_policy_and_compares_with_the_best_other() -> None:
    row = one("few-prefixes", seed=0, n=300, instances=2, ttft_slo_s=2.0)
    caps = row["capacity_rps"]
    assert set(caps) == set(PREFILL_POLICIES)
    assert all(c > 0 for c in caps.values())
    others = {k: v for k, v in caps.items() if k != "dualmap"}
    assert row["best_baseline"] == max(others, key=lambda k: others[k])
    assert row["dualmap_over_best"] == pytest.approx(caps["dualmap"] / max(others.values()))
    assert not row["held_out"]  # seed 0 was looked at when choosing the switch point
    # the reuse ceiling: no policy sustains more than every reusable prefix found
    assert row["ceiling_rps"] >= max(caps.values())
    assert row["groups"]["peers"]["ceiling_over"] == pytest.approx(
        row["ceiling_rps"] / caps[row["groups"]["peers"]["best"]])


def test_reuse_ceiling_counts_only_prefixes_an_earlier_prompt_had() -> None:
    cfg = SweepConfig(4, 4, 2.0, 0.1)  # 1e-4 s per uncached token
    shared = SimRequest(0, 0.0, 48, 1, (1, 2, 3))
    reqs = [shared, SimRequest(1, 0.1, 48, 1, (1, 2, 9)), SimRequest(2, 0.2, 40, 1, (7, 8))]
    # uncached: 48 (first), 16 (two blocks reused), 40 (nothing shared) = 104 tokens
    assert reuse_ceiling(reqs, cfg) == pytest.approx(4 * 3 / (104 * 1e-4))
    # control: the same prompts with nothing shared cost every token
    alone = [SimRequest(i, 0.0, 48, 1, (10 * i + 1, 10 * i + 2, 10 * i + 3)) for i in range(3)]
    assert reuse_ceiling(alone, cfg) == pytest.approx(4 * 3 / (144 * 1e-4))


def test_held_out_rows_are_untuned_shapes_at_untuned_seeds() -> None:
    assert not held_out("few-prefixes", 0)
    assert held_out("few-prefixes", TUNED_SEEDS)
    assert not held_out("default", TUNED_SEEDS)  # the shape DualMap was tuned on


def test_shapes_differ_from_the_default_trace() -> None:
    """The shapes change the workload (were they ignored, the three means would be equal)."""
    block = WorkloadConfig().block_tokens
    prompts = {s: statistics.mean(r.prompt_tokens for r in shape_requests(s, 0, 200, block)[1])
               for s in ("default", "long-prompts", "api-heavy")}
    assert prompts["long-prompts"] > prompts["default"] > prompts["api-heavy"]
    assert set(TUNED) <= set(SHAPES)


def test_unknown_shape_is_refused() -> None:
    assert main(["--shapes", "nope"]) == 2
    assert main(["--first-seed", "-1"]) == 2
