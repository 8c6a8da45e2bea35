"""Every autoscaler decision is a metric, a log line and a record in a capped Redis list, and
`pdserve autoscale status` prints the recent ones (real Redis, the real Autoscaler step)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import redis

from router.autoscale.actuators import RedisActuator, decisions_key, desired_key
from router.autoscale.decisions import DecisionLog, DecisionRecord, format_records
from router.autoscale.planner import Decision, PlannerConfig
from router.autoscale.service import Autoscaler, AutoscalerSettings
from router.autoscale.signals import Snapshot
from serve.cli import main as cli_main
from serve.redis_server import RedisServer

PREFIX = "decisiontest"


def _s(name: str, value: float, **labels: str
       ) -> tuple[tuple[str, frozenset[tuple[str, str]]], float]:
    return (name, frozenset(labels.items())), value


def snapshots(requests: float) -> tuple[Snapshot, Snapshot]:
    """10 s apart: ``requests`` served, each 1000 uncached prompt tokens, 100 output tokens."""
    def prefill(n: float) -> dict:
        return dict([_s("vllm:prompt_tokens_by_source_total", 1000 * n, source="local_compute"),
                     _s("vllm:request_prompt_tokens_count", n),
                     _s("vllm:request_prompt_tokens_bucket", n, le="+Inf")])

    def decode(n: float) -> dict:
        return dict([_s("vllm:request_generation_tokens_sum", 100 * n),
                     _s("vllm:request_generation_tokens_count", n)])

    def router(n: float) -> dict:
        return dict([_s("pdserve_router_requests_received_total", n)])

    return (Snapshot(0.0, router(0), {"p0": prefill(0)}, {"d0": decode(0)}),
            Snapshot(10.0, router(requests), {"p0": prefill(requests)},
                     {"d0": decode(requests)}))


def metric(scaler: Autoscaler, name: str, **labels: str) -> float | None:
    return scaler.metrics.get_sample_value(name, labels)


#: instances slow enough that 30 req/s needs more than one of each (decode: 1,800 output
#: tokens/s per instance within the default 0.1 s TPOT)
PROFILE = {"prefill": {"overhead_s": 0.005, "per_token_s": 1e-4},
           "decode": {"step_s": 0.01, "per_seq_s": 5e-4, "kv_transfer_s_per_token": 0.0}}


def test_each_decision_is_a_metric_a_log_line_and_a_redis_record(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = redis_server.url
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    settings = AutoscalerSettings(redis_url=url, router_url="http://127.0.0.1:9", prefix=PREFIX,
                                  profile=str(profile),
                                  planner=PlannerConfig(max_replicas=8, correction_alpha=0.0))

    async def one_step() -> None:
        actuator = RedisActuator(url, PREFIX)
        scaler = Autoscaler(settings, actuator)
        try:
            await scaler.step(*snapshots(300))  # 30 req/s: both pools must grow from 1
        finally:
            await scaler.registry.close()
            await scaler.decision_log.close()
            await scaler._redis.aclose()
            await actuator.close()
        # metrics: desired vs current vs ready, the loads and the headroom per pool
        for pool in ("prefill", "decode"):
            desired = metric(scaler, "pdserve_autoscaler_desired_replicas", pool=pool)
            assert desired is not None and desired > 1
            assert metric(scaler, "pdserve_autoscaler_current_replicas", pool=pool) == 1
            assert metric(scaler, "pdserve_autoscaler_ready_replicas", pool=pool) == 1
            assert metric(scaler, "pdserve_autoscaler_decisions_total", pool=pool,
                          direction="up", reason="scale_up") == 1
            assert metric(scaler, "pdserve_autoscaler_headroom_ratio", pool=pool) == 1.0
        assert metric(scaler, "pdserve_autoscaler_load", pool="prefill",
                      kind="observed") == pytest.approx(30_000)
        assert metric(scaler, "pdserve_autoscaler_load", pool="decode",
                      kind="observed") == pytest.approx(3_000)

    with caplog.at_level(logging.INFO, logger="router.autoscale.service"):
        asyncio.run(one_step())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decision ")]
    assert len(lines) == 2
    assert lines[0].startswith("decision prefill: 1 -> ") and "(scale_up)" in lines[0]
    assert "load observed 30000.0" in lines[0] and "headroom 1.00" in lines[0]

    r = redis.Redis.from_url(url)
    try:
        raw = r.lrange(decisions_key(PREFIX), 0, -1)
        desired = {bytes(k).decode(): int(v)  # type: ignore[arg-type]
                   for k, v in r.hgetall(desired_key(PREFIX)).items()}
    finally:
        r.close()
    records = [json.loads(x) for x in raw]
    assert [(d["pool"], d["current"], d["reason"]) for d in records] == [
        ("decode", 1, "scale_up"), ("prefill", 1, "scale_up")]  # newest first
    assert {d["pool"]: d["desired"] for d in records} == desired
    for d in records:
        assert set(d) >= {"time", "pool", "current", "desired", "reason", "load",
                          "predicted_load", "observed_load", "headroom",
                          "capacity_per_instance"}

    assert cli_main(["autoscale", "status", "--redis", url, "--prefix", PREFIX]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["ago", "pool", "from", "to", "reason"]
    assert out[1].split()[1:5] == ["decode", "1", str(desired["decode"]), "scale_up"]
    assert out[2].split()[1:5] == ["prefill", "1", str(desired["prefill"]), "scale_up"]


def test_the_list_is_capped(redis_server: RedisServer) -> None:
    async def fill() -> list[DecisionRecord]:
        log = DecisionLog(redis_server.url, PREFIX + "cap", keep=3)
        try:
            for i in range(5):
                await log.record([Decision("decode", i, i + 1, "scale_up", 1.0, 1.0)],
                                 float(i))
            return await log.recent(10)
        finally:
            await log.close()

    records = asyncio.run(fill())
    assert [(r.current, r.desired) for r in records] == [(4, 5), (3, 4), (2, 3)]


def test_status_filters_changes_and_reports_unreachable_redis(
        redis_server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    async def fill() -> None:
        log = DecisionLog(redis_server.url, PREFIX + "chg")
        try:
            await log.record([Decision("prefill", 2, 3, "scale_up", 1.0, 1.0),
                              Decision("decode", 2, 2, "steady", 1.0, 1.0)], 0.0)
        finally:
            await log.close()

    asyncio.run(fill())
    args = ["autoscale", "status", "--redis", redis_server.url, "--prefix", PREFIX + "chg"]
    assert cli_main([*args, "--changes"]) == 0
    shown = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1] for line in shown] == ["prefill"]
    assert cli_main(args) == 0  # negative control: without the filter both show
    assert len(capsys.readouterr().out.splitlines()[1:]) == 2
    assert cli_main(["autoscale", "status", "--redis", "redis://127.0.0.1:9/0"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_format_records_empty() -> None:
    assert format_records([], 0.0) == "no autoscaler decisions recorded yet"
