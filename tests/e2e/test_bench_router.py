"""The load-test harness replays a BurstGPT-format trace through the pdserve router."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.synth import SynthConfig, synth_rows
from bench.trace import TraceStats, read_trace, write_trace
from tests.support.cluster import Cluster
from tests.support.metrics import scrape, value

pytestmark = pytest.mark.vllm


def test_replay_through_the_router(cluster: Cluster, workers: dict[str, str],
                                   tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    cfg = SynthConfig(duration_s=6, rate=2, dispersion=2, prompt_median=60, prompt_sigma=0.8,
                      response_median=6, response_sigma=0.5, max_prompt_tokens=600,
                      max_response_tokens=10, conversation_fraction=0.5, session_continue=0.7,
                      failure_fraction=0.0, seed=5)
    write_trace(synth_rows(cfg), trace, layout="v2")
    rows = list(read_trace(trace, stats=TraceStats()))
    before = scrape(workers["decode"])
    out = tmp_path / "run"
    assert main(["replay", "--trace", str(trace), "--url", cluster.url, "--time-scale", "2",
                 "--out", str(out), "--seed", "1", "--no-progress", "--no-plots"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_scheduled"] == summary["requests_completed"] == len(rows) > 0
    assert summary["requests_failed"] == 0
    with (out / "requests.csv").open() as fh:
        for req in csv.DictReader(fh):
            assert int(req["prompt_tokens"]) == int(req["server_prompt_tokens"])
            assert int(req["max_tokens"]) == int(req["output_tokens"])
    # The replay went prefill -> pull -> decode (a resent session turn that decode already holds
    # in full needs no pull), and no pull failed.
    after = scrape(workers["decode"])
    assert value(after, "pdserve_kv_pulls_total") > value(before, "pdserve_kv_pulls_total")
    failures = "pdserve_kv_pull_failures_total"
    assert value(after, failures) == value(before, failures)
