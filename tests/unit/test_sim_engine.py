"""The simulator: trace reading, the prefix model, and DualMap winning on a small config."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sim.engine import simulate
from bench.sim.perf import load_calibration
from bench.sim.sweep import SweepConfig, effective_capacity
from bench.sim.trace_input import TraceError, native_rate, read_trace, synth_rows, write_trace
from bench.sim.workload import WorkloadConfig, build_requests
from router.policy.registry import BASELINES, create_prefill_policy


def test_trace_roundtrip_by_header_and_drops_failures(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("Model,Timestamp,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "ChatGPT,30,5000,9000,14000,Conversation log\n"
                    "ChatGPT,10,100,20,120,Conversation log\n"
                    "GPT-4,20,50,0,50,API log\n")
    rows = read_trace(path)
    assert [(r.timestamp_s, r.request_tokens, r.response_tokens) for r in rows] == [
        (10.0, 100, 20), (30.0, 5000, 9000)]
    write_trace(tmp_path / "u.csv", rows)
    assert read_trace(tmp_path / "u.csv") == rows


@pytest.mark.parametrize(("text", "match"), [
    ("a,b\n1,2\n", "missing column"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "x,ChatGPT,1,1,2,API log\n", "bad value"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n", "no successful"),
])
def test_bad_traces(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=match):
        read_trace(path)


def test_sessions_share_prefixes() -> None:
    rows = synth_rows(200, seed=3)
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
    rows = synth_rows(1, seed=0)
    req = build_requests(rows, WorkloadConfig(), seed=0)[0]
    res = simulate([req], create_prefill_policy("round_robin"), 2, 1)
    # defaults: prefill 0.02 + 1e-4 x tokens; transfer 5e-6 x tokens; decode step 0.012 +
    # 1e-4 x 1 + 2e-8 x tokens
    n = req.prompt_tokens
    expected = 0.02 + 1e-4 * n + 5e-6 * n + 0.012 + 1e-4 + 2e-8 * n
    assert res.ttft_s == [pytest.approx(expected)]
    assert res.cached_tokens == 0


def test_calibration_overrides_and_rejects_unknown(tmp_path: Path) -> None:
    good = tmp_path / "c.json"
    good.write_text('{"prefill": {"per_token_s": 2e-4}, "decode": {"step_s": 0.03}}')
    p, d = load_calibration(good)
    assert (p.per_token_s, d.step_s, p.overhead_s) == (2e-4, 0.03, 0.02)
    bad = tmp_path / "b.json"
    bad.write_text('{"prefill": {"tokens_per_s": 1}}')
    with pytest.raises(ValueError, match="unknown prefill keys"):
        load_calibration(bad)


def test_dualmap_has_the_highest_effective_capacity_small_config() -> None:
    rows = synth_rows(2000, rate_rps=2.0, seed=1)
    reqs = build_requests(rows, WorkloadConfig(), seed=1)
    cfg = SweepConfig(n_prefill=16, n_decode=16, ttft_slo_s=2.0, tpot_slo_s=0.1, bisect_steps=5)
    native = native_rate(rows)
    caps = {name: effective_capacity(name, reqs, cfg, native, start_rps=20.0)[0]
            for name in ("dualmap", *BASELINES)}
    best_baseline = max(caps[n] for n in BASELINES)
    assert caps["dualmap"] > best_baseline, caps
