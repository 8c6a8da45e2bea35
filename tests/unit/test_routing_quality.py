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
from bench.sim.workload import WorkloadConfig
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
