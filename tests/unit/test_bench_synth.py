"""Synthetic traces: deterministic, bursty when asked, heavy-tailed, sessions resend history;
the simulator's gamma-arrival generators: one seed, one trace."""

from __future__ import annotations

import io
from collections import defaultdict

import numpy as np
import pytest

from bench.synth import (
    SynthConfig,
    gamma_rows,
    iter_gamma_rows,
    iter_varying_rows,
    synth_rows,
)
from bench.trace import TraceStats, native_rate, per_second_counts, read_trace, trace_to_text


def test_deterministic_for_a_seed() -> None:
    cfg = SynthConfig(duration_s=60, rate=2, seed=7)
    assert list(synth_rows(cfg)) == list(synth_rows(cfg))
    assert list(synth_rows(cfg)) != list(synth_rows(SynthConfig(duration_s=60, rate=2, seed=8)))


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_written_trace_reads_back(layout: str) -> None:
    rows = list(synth_rows(SynthConfig(duration_s=120, rate=3, failure_fraction=0.1, seed=1)))
    stats = TraceStats()
    back = list(read_trace(io.StringIO(trace_to_text(rows, layout)), stats=stats))
    kept = [r for r in rows if r.response_tokens > 0]
    assert stats.dropped.get("failed", 0) == len(rows) - len(kept) > 0
    assert [(r.timestamp_s, r.request_tokens, r.response_tokens) for r in back] == \
        [(r.timestamp_s, r.request_tokens, r.response_tokens) for r in kept]
    if layout == "v2":
        assert [r.session_id for r in back] == [r.session_id for r in kept]


def test_mean_rate_and_dispersion() -> None:
    def counts(dispersion: float) -> np.ndarray:
        rows = synth_rows(SynthConfig(duration_s=4000, rate=5, dispersion=dispersion, seed=2))
        return np.array(per_second_counts(r.timestamp_s for r in rows))

    poisson, bursty = counts(1.0), counts(6.0)
    assert poisson.mean() == pytest.approx(5, rel=0.05)
    assert bursty.mean() == pytest.approx(5, rel=0.1)
    assert poisson.var() / poisson.mean() == pytest.approx(1.0, abs=0.15)
    assert bursty.var() / bursty.mean() == pytest.approx(6.0, rel=0.2)


def test_heavy_tailed_lengths_within_clamps() -> None:
    cfg = SynthConfig(duration_s=2000, rate=5, max_prompt_tokens=8000, seed=4,
                      conversation_fraction=0.0)
    req = np.array([r.request_tokens for r in synth_rows(cfg)])
    assert req.min() >= 1 and req.max() <= 8000
    assert np.median(req) == pytest.approx(600, rel=0.1)
    assert np.percentile(req, 99) > 5 * np.median(req)  # a long tail, not a narrow bell


def test_session_turns_resend_history() -> None:
    rows = list(synth_rows(SynthConfig(duration_s=600, rate=2, conversation_fraction=1.0,
                                       session_continue=0.8, seed=5)))
    by_session = defaultdict(list)
    for r in rows:
        assert r.log_type == "Conversation log" and r.session_id
        by_session[r.session_id].append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.request_tokens > prev.request_tokens + prev.response_tokens


def test_invalid_config() -> None:
    with pytest.raises(ValueError, match="dispersion"):
        SynthConfig(dispersion=0.5)
    with pytest.raises(ValueError, match="gpt4_fraction"):
        SynthConfig(gpt4_fraction=2)


def test_fixed_shape_rows_exact_count_lengths_and_rate() -> None:
    from bench.synth import fixed_shape_rows

    rows = fixed_shape_rows(400, input_tokens=512, output_tokens=64, rate=4.0, seed=3)
    assert len(rows) == 400
    assert {(r.request_tokens, r.response_tokens, r.session_id, r.log_type) for r in rows} == {
        (512, 64, None, "API log")}
    ts = [r.timestamp_s for r in rows]
    assert ts == sorted(ts)
    assert (ts[-1] - ts[0]) / 399 == pytest.approx(1 / 4.0, rel=0.15)  # Poisson mean gap
    assert fixed_shape_rows(400, input_tokens=512, output_tokens=64, rate=4.0, seed=3) == rows
    burst = fixed_shape_rows(5, input_tokens=8, output_tokens=2)  # rate inf: all at once
    assert [r.timestamp_s for r in burst] == [0.0] * 5
    with pytest.raises(ValueError):
        fixed_shape_rows(0, input_tokens=8, output_tokens=2)


def _shape(rows: object) -> list[tuple[float, int, int, str]]:
    return [(r.timestamp_s, r.request_tokens, r.response_tokens, r.log_type)
            for r in rows]  # type: ignore[attr-defined]


def test_gamma_rows_one_seed_one_trace() -> None:
    """The simulator's tables depend on the rows a seed gives: same seed, same rows (lazy or
    not, with or without session ids); another seed, other rows."""
    rows = gamma_rows(500, rate_rps=3.0, seed=5)
    assert rows == gamma_rows(500, rate_rps=3.0, seed=5)
    assert rows == list(iter_gamma_rows(500, rate_rps=3.0, seed=5))
    assert rows != gamma_rows(500, rate_rps=3.0, seed=6)
    bare = list(iter_gamma_rows(500, rate_rps=3.0, seed=5, session_ids=False))
    assert _shape(bare) == _shape(rows) and all(r.session_id is None for r in bare)
    assert any(r.session_id for r in rows)
    assert all(r.total_tokens == r.request_tokens + r.response_tokens for r in rows)
    assert native_rate(gamma_rows(4000, rate_rps=3.0, seed=1)) == pytest.approx(3.0, rel=0.1)


def test_varying_rows_follow_the_knots() -> None:
    knots = [(0.0, 1.0), (100.0, 1.0), (101.0, 10.0), (200.0, 10.0)]
    rows = list(iter_varying_rows(knots, seed=2))
    assert rows == list(iter_varying_rows(knots, seed=2))
    assert rows != list(iter_varying_rows(knots, seed=3))
    assert rows[-1].timestamp_s <= 200.0
    slow = sum(r.timestamp_s < 100 for r in rows)
    fast = sum(r.timestamp_s >= 101 for r in rows)
    assert 4 * slow < fast  # 10x the rate after the step
    for bad in ([(0.0, 1.0)], [(0.0, 1.0), (0.0, 2.0)], [(0.0, 1.0), (5.0, 0.0)]):
        with pytest.raises(ValueError, match="knot"):
            list(iter_varying_rows(bad))
