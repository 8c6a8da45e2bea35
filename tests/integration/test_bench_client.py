"""The open-loop client against a tiny local fake endpoint: lag is recorded, errors are data."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cli import main
from bench.client import ClientConfig, RequestSpec, run_open_loop
from bench.client_speed import fake_server
from bench.synth import SynthConfig, synth_rows
from bench.trace import write_trace
from serve.redis_server import free_port
from serve.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with fake_server(tokens=3) as url:
        yield url


async def test_every_request_sent_and_lag_recorded(fake_url: str) -> None:
    n, rate = 300, 200.0
    specs = [RequestSpec(i, i / rate, "hello", 1, 3) for i in range(n)]
    run = await run_open_loop(specs, ClientConfig(url=fake_url, model="fake"))
    assert [r.index for r in run.results] == list(range(n))
    assert all(r.ok and r.output_tokens == 3 and len(r.token_times_s) == 3
               for r in run.results)
    for r in run.results:
        assert math.isfinite(r.lag_s) and r.lag_s >= 0
        assert r.sent_s == pytest.approx(r.scheduled_s + r.lag_s)
        assert r.token_times_s == sorted(r.token_times_s) and r.token_times_s[0] >= 0
    assert run.duration_s >= specs[-1].at_s


async def test_failures_are_recorded_not_raised(fake_url: str) -> None:
    specs = [RequestSpec(0, 0.0, "FAIL500", 1, 3), RequestSpec(1, 0.0, "HANG", 1, 3),
             RequestSpec(2, 0.0, "ERREVENT", 1, 3), RequestSpec(3, 0.01, "fine", 1, 5)]
    run = await run_open_loop(specs, ClientConfig(url=fake_url, model="fake", timeout_s=1.0))
    got = {r.index: (r.ok, r.error_type) for r in run.results}
    assert got == {0: (False, "http_500"), 1: (False, "timeout"), 2: (False, "stream_error"),
                   3: (True, "")}
    assert run.results[0].status_code == 500 and "boom" in run.results[0].error
    assert "worker died" in run.results[2].error


async def test_connection_refused_is_recorded() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = await run_open_loop([RequestSpec(0, 0.0, "x", 1, 1)], ClientConfig(url=url, model="m"))
    assert run.results[0].error_type == "connect_error" and not run.results[0].ok


def test_request_body_asks_for_exact_lengths() -> None:
    from bench.client import _body

    body = _body(ClientConfig(url="http://x", model="m"), RequestSpec(0, 0.0, "p", 1, 17))
    assert body["max_tokens"] == 17 and body["ignore_eos"] is True and body["stream"] is True
    assert body["prompt"] == "p" and body["stream_options"] == {"include_usage": True}
    chat = _body(ClientConfig(url="http://x", model="m", endpoint="chat"),
                 RequestSpec(0, 0.0, "p", 1, 2))
    assert chat["messages"] == [{"role": "user", "content": "p"}] and "prompt" not in chat


def test_sweep_cli(fake_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    write_trace(synth_rows(SynthConfig(duration_s=10, rate=3, prompt_median=20,
                                       response_median=3, max_response_tokens=5, seed=1)), trace)
    out = tmp_path / "sweep"
    rc = main(["sweep", "--trace", str(trace), "--url", fake_url, "--tokenizer",
               str(build_tiny_model()), "--rates", "20,60", "--slo-ttft", "5", "--slo-tpot", "1",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["schema"] == "pdserve.bench.sweep/1" and doc["max_rate_rps"] == 60
    assert [p["rate"] for p in doc["points"]] == [20, 60]
    assert (out / "rate_20" / "summary.json").exists() and (out / "report.md").exists()
    assert (out / "attainment_vs_rate.png").exists()
    a, b = out / "rate_20" / "summary.json", out / "rate_60" / "summary.json"
    assert main(["compare", str(a), str(b)]) == 0
