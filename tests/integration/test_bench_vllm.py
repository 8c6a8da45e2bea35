"""`pdserve bench` against a real vLLM server on the tiny model.

One plain vLLM server is started for this module (about a minute on 2 cores) and reused.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.cli import main
from bench.synth import SynthConfig, synth_rows
from bench.trace import TraceStats, read_trace, write_trace
from router.autoscale.profile import InstanceProfile
from serve.tiny_model import build_tiny_model
from tests.support.cluster import SERVED_NAME, running_plain

pytestmark = pytest.mark.vllm
REQUIRED_KEYS = ("requests_scheduled", "requests_completed", "requests_failed", "ttft_p50",
                 "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "slo_attainment", "goodput_rps",
                 "schedule_lag_p99")


@pytest.fixture(scope="module")
def vllm_url() -> Iterator[str]:
    with running_plain(build_tiny_model()) as plain:
        yield plain.url


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.csv"
    cfg = SynthConfig(duration_s=8, rate=2, dispersion=2, prompt_median=40, prompt_sigma=0.8,
                      response_median=6, response_sigma=0.5, max_prompt_tokens=400,
                      max_response_tokens=12, conversation_fraction=0.6, session_continue=0.7,
                      failure_fraction=0.1, seed=11)
    write_trace(synth_rows(cfg), path, layout="v2")
    return path


def test_replay_against_vllm(vllm_url: str, trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = main(["replay", "--trace", str(trace), "--url", vllm_url, "--time-scale", "2",
               "--slo-ttft", "2.0", "--slo-tpot", "0.5", "--out", str(out), "--seed", "3",
               "--no-progress"])
    assert rc == 0
    stats = TraceStats()
    rows = list(read_trace(trace, stats=stats))
    summary = json.loads((out / "summary.json").read_text())
    for key in REQUIRED_KEYS:
        assert key in summary, key
    assert summary["schema"] == "pdserve.bench.run/1"
    assert summary["config"]["model"] == SERVED_NAME
    assert summary["trace"]["dropped"] == stats.dropped and stats.dropped.get("failed", 0) > 0

    # Every scheduled request was sent, in schedule order, with its lag recorded.
    with (out / "requests.csv").open() as fh:
        reqs = list(csv.DictReader(fh))
    assert summary["requests_scheduled"] == len(reqs) == len(rows)
    assert summary["requests_completed"] == len(rows) and summary["requests_failed"] == 0
    for req, row in zip(reqs, rows, strict=True):
        assert float(req["scheduled_s"]) == pytest.approx((row.timestamp_s - rows[0].timestamp_s)
                                                          / 2, abs=1e-6)
        assert float(req["lag_s"]) >= 0
        assert float(req["sent_s"]) == pytest.approx(float(req["scheduled_s"])
                                                     + float(req["lag_s"]), abs=1e-5)
        # Token counts asked for match the trace; the server saw exactly those.
        assert int(req["trace_line"]) == row.line
        assert int(req["prompt_tokens"]) == int(req["server_prompt_tokens"]) \
            == row.request_tokens
        assert int(req["max_tokens"]) == int(req["output_tokens"]) == row.response_tokens

    # Metrics recomputed by hand from the recorded timestamps.
    times = [json.loads(r["token_times_s"]) for r in reqs]
    outs = [int(r["output_tokens"]) for r in reqs]
    ttft = [t[0] for t in times]
    e2e = [t[-1] for t in times]
    tpot = [(t[-1] - t[0]) / (n - 1) for t, n in zip(times, outs, strict=True) if n > 1]
    assert summary["ttft_p50"] == pytest.approx(statistics.median(ttft), abs=2e-6)
    assert summary["e2e_p50"] == pytest.approx(statistics.median(e2e), abs=2e-6)
    assert summary["tpot_p50"] == pytest.approx(statistics.median(tpot), abs=2e-6)
    assert summary["ttft_p99"] == pytest.approx(float(np.percentile(ttft, 99)), abs=2e-6)
    good = sum(1 for a, t, n in zip(ttft, times, outs, strict=True)
               if a <= 2.0 and (n < 2 or (t[-1] - t[0]) / (n - 1) <= 0.5))
    assert summary["slo_attainment"] == pytest.approx(good / len(reqs), abs=1e-9)
    assert summary["schedule_lag_p99"] is not None
    for name in ("report.md", "latency_cdf.png", "ttft_over_time.png"):
        assert (out / name).stat().st_size > 0


def test_replay_chat_endpoint_with_rate(vllm_url: str, trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "chat"
    rc = main(["replay", "--trace", str(trace), "--url", vllm_url, "--endpoint", "chat",
               "--rate", "4", "--max-requests", "4", "--out", str(out), "--no-progress",
               "--no-plots"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_completed"] == summary["requests_scheduled"] == 4
    assert summary["trace"]["offered_rate_rps"] == pytest.approx(4.0)


def test_profile_against_vllm(vllm_url: str, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    rc = main(["profile", "--url", vllm_url, "--out", str(out), "--prompt-lengths", "16,256",
               "--batch-sizes", "1,4", "--repeats", "1", "--decode-tokens", "8"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "pdserve.bench.profile/1" and doc["model"] == SERVED_NAME
    assert [p["tokens"] for p in doc["prefill"]["points"]] == [16, 256]
    assert [p["batch_size"] for p in doc["decode"]["points"]] == [1, 4]
    assert all(p["step_s"] > 0 for p in doc["decode"]["points"])
    assert doc["prefill"]["per_token_s"] >= 0 and doc["prefill"]["fixed_s"] >= 0
    assert doc["box"]["copy_gbps"] > 0 and doc["box"]["loop_mops"] > 0  # the machine's speed
    assert InstanceProfile.load(out).decode.step_s > 0  # and what the simulator reads of it
