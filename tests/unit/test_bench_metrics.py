"""Metrics from recorded timestamps against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.client import RequestResult
from bench.metrics import (
    distribution,
    meets_slo,
    parse_percentiles,
    percentile,
    percentile_word,
    summarize,
)


def res(index: int, times: list[float], out: int, *, ok: bool = True, lag: float = 0.001,
        error: str = "") -> RequestResult:
    return RequestResult(index, scheduled_s=float(index), prompt_tokens=10, max_tokens=out,
                         sent_s=index + lag, lag_s=lag, token_times_s=times, output_tokens=out,
                         ok=ok, error_type=error)


RUN = [
    res(0, [0.1, 0.2, 0.3, 0.5], 4),     # TTFT .1, E2E .5, TPOT .4/3, ITL .1 .1 .2
    res(1, [0.3, 0.4], 2, lag=0.003),    # TTFT .3, E2E .4, TPOT .1,   ITL .1
    res(2, [0.2], 1),                    # TTFT .2, E2E .2, no TPOT
    res(3, [], 5, ok=False, error="timeout"),
]


def test_per_request_values() -> None:
    r = RUN[0]
    assert r.ttft_s == 0.1 and r.e2e_s == 0.5
    assert r.tpot_s == pytest.approx(0.4 / 3)
    assert r.itl_s == pytest.approx([0.1, 0.1, 0.2])
    assert RUN[2].tpot_s is None and RUN[3].ttft_s is None


def test_summary_hand_computed() -> None:
    s = summarize(RUN, duration_s=4.0, slo_ttft_s=0.25, slo_tpot_s=0.12)
    assert (s["requests_scheduled"], s["requests_completed"], s["requests_failed"]) == (4, 3, 1)
    assert s["errors"] == {"timeout": 1}
    assert s["ttft_mean"] == pytest.approx(0.2)
    assert s["ttft_p50"] == pytest.approx(0.2)
    assert s["ttft_p90"] == pytest.approx(0.28)  # 0.2 + 0.8 * (0.3 - 0.2)
    assert s["e2e_p50"] == pytest.approx(0.4)
    assert s["tpot_p50"] == pytest.approx((0.4 / 3 + 0.1) / 2)
    assert s["itl_p50"] == pytest.approx(0.1)
    assert s["output_tokens"] == 7 and s["input_tokens"] == 30
    assert s["request_throughput_rps"] == pytest.approx(0.75)
    assert s["output_token_throughput_tps"] == pytest.approx(7 / 4)
    # Request 0: TTFT ok, TPOT 0.133 > 0.12; request 1: TTFT 0.3 > 0.25; request 2 meets
    # both (one token: no TPOT); request 3 failed.
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["goodput_rps"] == pytest.approx(1 / 4)
    assert s["schedule_lag_max"] == pytest.approx(0.003)
    assert s["requests_sent"] == 4


def test_unset_slos_always_hold_and_empty_runs() -> None:
    assert meets_slo(RUN[0], None, None) and not meets_slo(RUN[3], None, None)
    assert summarize(RUN, 4.0)["slo_attainment"] == pytest.approx(0.75)
    empty = summarize([], 0.0)
    assert empty["slo_attainment"] is None and empty["goodput_rps"] is None
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_vllm_bench_serve_names_in_milliseconds() -> None:
    """`vllm bench serve`'s result keys, so its consumers read our runs unchanged."""
    s = summarize(RUN, duration_s=4.0, slo_ttft_s=0.25, slo_tpot_s=0.12)
    assert (s["completed"], s["failed"], s["duration"]) == (3, 1, 4.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 7)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(7 / 4)
    assert s["request_goodput"] == pytest.approx(0.25)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 * (300 - 200)
    assert s["std_ttft_ms"] == pytest.approx(81.6497, rel=1e-4)  # population std of .1 .2 .3
    assert s["median_e2el_ms"] == pytest.approx(400.0)
    assert s["mean_itl_ms"] == pytest.approx(125.0)  # .1 .1 .2 .1
    assert summarize(RUN, 4.0)["request_goodput"] is None  # no SLO: no goodput, as vLLM
    assert summarize([], 0.0)["mean_tpot_ms"] is None


def test_a_run_that_fell_behind_its_schedule_is_flagged() -> None:
    assert summarize(RUN, 4.0)["timing_valid"] is True  # p99 lag ~3 ms
    late = [res(i, [0.1], 1, lag=0.001 if i else 0.2) for i in range(3)]
    assert summarize(late, 4.0)["timing_valid"] is False


def test_configured_percentiles_use_vllm_names_and_numpy_values() -> None:
    """``--percentiles 25,75,99.9`` gives exactly those vLLM keys (``p99.9_ttft_ms``, ms, numpy's
    linear interpolation) for ttft, tpot, itl and e2el; our second-based keys keep 50/90/99."""
    ttft_ms = [100.0, 300.0, 200.0]  # RUN's TTFTs, in RUN's order
    tpot_ms = [0.4 / 3 * 1e3, 100.0]
    itl_ms = [100.0, 100.0, 200.0, 100.0]
    e2el_ms = [500.0, 400.0, 200.0]
    s = summarize(RUN, 4.0, percentiles=parse_percentiles("25,75,99.9"))
    for name, values in (("ttft", ttft_ms), ("tpot", tpot_ms), ("itl", itl_ms),
                         ("e2el", e2el_ms)):
        for p, word in ((25, "25"), (75, "75"), (99.9, "99.9")):
            assert s[f"p{word}_{name}_ms"] == pytest.approx(float(np.percentile(values, p)))
        for p in (50, 90, 99):
            assert f"p{p}_{name}_ms" not in s  # as vLLM: only the percentiles asked for
    assert s["p25_ttft_ms"] == pytest.approx(150.0)  # 100 + 0.5 * (200 - 100), by hand
    assert s["p75_e2el_ms"] == pytest.approx(450.0)  # 400 + 0.5 * (500 - 400)
    assert s["ttft_p25"] == pytest.approx(0.15) and s["ttft_p99.9"] == pytest.approx(
        float(np.percentile([0.1, 0.3, 0.2], 99.9)))
    assert s["ttft_p50"] == pytest.approx(0.2) and s["schedule_lag_p99"] is not None
    default = summarize(RUN, 4.0)
    assert {k for k in default if k.startswith("p") and k.endswith("_ttft_ms")} == {
        "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"}


@pytest.mark.parametrize(("text", "want"), [
    ("50,90,99", (50.0, 90.0, 99.0)), ("99", (99.0,)), (" 99.9 , 50", (99.9, 50.0)),
    ("99,99", (99.0,))])
def test_parse_percentiles(text: str, want: tuple[float, ...]) -> None:
    assert parse_percentiles(text) == want


@pytest.mark.parametrize("text", ["", "abc", "101", "-1", "50,,x"])
def test_parse_percentiles_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="percentiles"):
        parse_percentiles(text)


def test_percentile_word_as_vllm() -> None:
    assert [percentile_word(p) for p in (50, 99.0, 99.9, 0.5)] == ["50", "99", "99.9", "0.5"]


def test_slot_wait_is_not_schedule_lag() -> None:
    """A request that waited for a --max-concurrency slot was not late by the client's fault."""
    queued = [res(i, [0.1], 1, lag=0.001) for i in range(3)]
    for i, r in enumerate(queued):
        r.queue_s = 0.5 * i
    s = summarize(queued, 4.0)
    assert s["timing_valid"] is True and s["client_queue_p50"] == pytest.approx(0.5)


def test_percentile_interpolates_between_ranks_by_hand() -> None:
    """Linear between the two nearest ranks, not nearest rank (which gives 40 and 1000 here)."""
    assert percentile([40.0, 10.0, 30.0, 20.0], 90) == pytest.approx(37.0)  # rank 2.7 of 0..3
    assert percentile([100, 200, 300, 400, 1000], 90) == pytest.approx(760.0)
    assert percentile([10.0, 20.0], 50) == 15.0
    assert percentile([10.0, 20.0], 0) == 10.0 and percentile([10.0, 20.0], 100) == 20.0


@given(st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=1, max_size=60),
       st.floats(0.0, 100.0))
def test_percentile_equals_numpy(values: list[float], p: float) -> None:
    assert percentile(values, p) == float(np.percentile(values, p))


def test_percentile_of_one_value_and_of_none() -> None:
    assert percentile([3.5], 0) == percentile([3.5], 99) == 3.5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    assert percentile([], 50, empty=0.0) == 0.0
    for bad in (-1.0, 100.5, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 100\]"):
            percentile([1.0, 2.0], bad)
