"""Metrics from recorded timestamps against hand-computed values."""

from __future__ import annotations

import pytest

from bench.client import RequestResult
from bench.metrics import distribution, meets_slo, summarize


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
