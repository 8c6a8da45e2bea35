"""The simulator: the prefix model, timing by hand, and DualMap winning on a small config
(trace reading is ``tests/unit/test_bench_trace.py``'s)."""

from __future__ import annotations

import pytest

from bench.sim.engine import simulate
from bench.sim.sweep import SweepConfig, effective_capacity
from bench.sim.workload import WorkloadConfig, build_requests
from bench.synth import gamma_rows
from bench.trace import native_rate
from router.policy.registry import BASELINES, create_prefill_policy


def test_sessions_share_prefixes() -> None:
    rows = gamma_rows(200, seed=3)
    reqs = build_requests(rows, WorkloadConfig(), seed=3)
    by_session: dict[str, list[int]] = {}
    for row, req in zip(rows, reqs, strict=True):
        if row.session_id:
            by_session.setdefault(row.session_id, []).append(req.index)
    multi = [ix for ix in by_session.values() if len(ix) > 1]
    assert multi
    for ix in multi:
        first, second = reqs[ix[0]], reqs[ix[1]]
        # the second turn resends the first turn: its blocks extend the first prompt's blocks
        assert second.block_hashes[:len(first.block_hashes)] == first.block_hashes
        assert second.prompt_tokens > first.prompt_tokens


def test_single_request_timing_by_hand() -> None:
    rows = gamma_rows(1, seed=0)
    req = build_requests(rows, WorkloadConfig(), seed=0)[0]
    res = simulate([req], create_prefill_policy("round_robin"), 2, 1)
    # defaults: prefill 0.02 + 1e-4 x tokens; transfer 5e-6 x tokens; decode step 0.012 +
    # 1e-4 x 1 + 2e-8 x tokens
    n = req.prompt_tokens
    expected = 0.02 + 1e-4 * n + 5e-6 * n + 0.012 + 1e-4 + 2e-8 * n
    assert res.ttft_s == [pytest.approx(expected)]
    assert res.cached_tokens == 0


def test_dualmap_has_the_highest_effective_capacity_small_config() -> None:
    rows = gamma_rows(2000, rate_rps=2.0, seed=1)
    reqs = build_requests(rows, WorkloadConfig(), seed=1)
    cfg = SweepConfig(n_prefill=16, n_decode=16, ttft_slo_s=2.0, tpot_slo_s=0.1, bisect_steps=5)
    native = native_rate(rows)
    caps = {name: effective_capacity(name, reqs, cfg, native, start_rps=20.0)[0]
            for name in ("dualmap", *BASELINES)}
    best_baseline = max(caps[n] for n in BASELINES)
    assert caps["dualmap"] > best_baseline, caps
