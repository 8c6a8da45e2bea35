"""Synthetic traces: deterministic, bursty when asked, heavy-tailed, sessions resend history."""

from __future__ import annotations

import io
from collections import defaultdict

import numpy as np
import pytest

from bench.synth import SynthConfig, synth_rows
from bench.trace import TraceStats, per_second_counts, read_trace, trace_to_text


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
