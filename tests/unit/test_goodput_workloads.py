"""The goodput benchmark's rate-point traces: each lasts its wall span at its rate, and a
switching trace changes phase every ``phase_s`` wall seconds whatever the rate."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from bench.goodput_workloads import WARMUP, WORKLOADS, phase_count, prompt_seed, rate_point_trace
from bench.prompts import PromptSynthesizer, load_tokenizer
from bench.trace import TraceRow, read_trace
from serve.tiny_model import build_tiny_model


@pytest.mark.parametrize("rate", [4.0, 16.0])
def test_a_rate_point_has_rate_times_span_requests(tmp_path: Path, rate: float) -> None:
    rows = list(read_trace(rate_point_trace(WORKLOADS["mix"], tmp_path / "t.csv", rate, 30.0,
                                            seed=3)))
    # BurstGPT-shaped arrivals at 1 req/s: the count is rate x span, give or take the bursts
    assert 0.8 * rate * 30 <= len(rows) <= 1.2 * rate * 30


def test_switching_changes_phase_every_phase_s_at_any_rate(tmp_path: Path) -> None:
    switching = WORKLOADS["switching"]
    span = switching.point_s(30.0)
    assert span == 60.0  # every phase twice, though 30 s was asked for
    phases = phase_count(switching, span)
    assert phases == 4
    for rate in (3.0, 12.0):
        rows = list(read_trace(rate_point_trace(switching, tmp_path / f"s{rate}.csv", rate,
                                                span, seed=5)))
        # replayed at `rate`, trace time / rate is wall time: phase p covers
        # [p * phase_s, (p + 1) * phase_s) wall seconds
        by_phase: list[list[int]] = [[] for _ in range(phases)]
        for r in rows:
            wall = r.timestamp_s / rate
            by_phase[min(int(wall // switching.phase_s), phases - 1)].append(r.request_tokens)
        medians = [statistics.median(p) for p in by_phase]
        # prefill_heavy phases (1,500-token prompts) and decode_heavy ones (150) alternate
        assert medians[0] > 700 and medians[2] > 700, medians
        assert medians[1] < 400 and medians[3] < 400, medians


def test_phase_count_never_drops_below_two() -> None:
    assert phase_count(WORKLOADS["switching"], 5.0) == 2
    assert phase_count(WORKLOADS["switching"], 90.0) == 6


def test_each_rate_point_sends_its_own_prompts(tmp_path: Path) -> None:
    """A longer trace of one seed starts with a shorter one's rows: with one prompt seed for
    every point, those rows were sent again word for word and served from the caches the
    point before filled. Each point's prompt seed is its own, the same for every setup."""
    workload = WORKLOADS["prefill_heavy"]
    low = list(read_trace(rate_point_trace(workload, tmp_path / "a.csv", 1.0, 20.0, seed=2)))
    high = list(read_trace(rate_point_trace(workload, tmp_path / "b.csv", 2.0, 20.0, seed=2)))
    shared = 3
    # the rows themselves repeat: what each point sends must not
    assert [r.request_tokens for r in low[:shared]] == [r.request_tokens for r in high[:shared]]
    tokenizer = load_tokenizer(str(build_tiny_model()))

    def prompts(rows: list[TraceRow], seed: int) -> list[str]:
        synth = PromptSynthesizer(tokenizer, seed=seed)
        return [synth.prompt(r.request_tokens).text for r in rows[:shared]]

    seeds = {prompt_seed(2, 1.0), prompt_seed(2, 2.0), prompt_seed(2, WARMUP),
             prompt_seed(3, 1.0)}
    assert len(seeds) == 4
    assert prompt_seed(2, 2.0) == prompt_seed(2, 2)  # a pure function of (seed, rate)
    a, b = prompts(low, prompt_seed(2, 1.0)), prompts(high, prompt_seed(2, 2.0))
    # not even a first block in common: no prefix of one point is cached for the next
    assert all(x.split()[:16] != y.split()[:16] for x, y in zip(a, b, strict=True))
    # negative control: one seed for both points sends the same prompts again
    assert prompts(low, 0) == prompts(high, 0)
