"""The one instance profile: its file format (what `pdserve bench profile` writes), its errors,
its formulas, and that the simulator and the autoscaler's capacity planning use it alike."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench.autoscale_sim import make_trace, run
from bench.profile import profile_document
from bench.sim.autoscale import AutoscaleSettings, PlannerController, make_controller
from bench.sim.engine import simulate
from bench.sim.workload import SimRequest
from router.autoscale.capacity import DecodeModel, PrefillModel, capacity_models
from router.autoscale.profile import (
    PROFILE_SCHEMA,
    DecodePerf,
    InstanceProfile,
    PrefillPerf,
    fit_line,
)
from router.errors import ConfigError
from router.policy.registry import create_prefill_policy

# a measured world: prefill TTFT = 0.03 + 2e-4 x tokens, decode step = 0.015 + 0.002 x batch
PREFILL_POINTS = [{"tokens": n, "ttft_s": 0.03 + 2e-4 * n} for n in (32, 128, 512, 1024)]
DECODE_POINTS = [{"batch_size": b, "step_s": 0.015 + 0.002 * b} for b in (1, 2, 4, 8, 16)]
ODD = InstanceProfile(PrefillPerf(0.03, 3e-4, 1e-5, 4096, 1000, 32),
                      DecodePerf(0.02, 3e-4, 5e-8, 64, 7e-6))


def write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return path


def test_reads_what_bench_profile_writes(tmp_path: Path) -> None:
    doc = profile_document("http://w:8000", "m", PREFILL_POINTS, DECODE_POINTS, 32)
    doc["box"] = {"copy_gbps": 9.9, "loop_mops": 33.2}  # as `bench profile` adds it
    assert doc["schema"] == PROFILE_SCHEMA
    profile = InstanceProfile.load(write(tmp_path, doc))
    assert profile.prefill.overhead_s == pytest.approx(0.03)
    assert profile.prefill.per_token_s == pytest.approx(2e-4)
    assert profile.decode.step_s == pytest.approx(0.015)
    assert profile.decode.per_seq_s == pytest.approx(0.002)
    # what a profile does not measure keeps the default
    default = InstanceProfile()
    assert profile.prefill.cache_blocks == default.prefill.cache_blocks
    assert profile.decode.kv_transfer_s_per_token == default.decode.kv_transfer_s_per_token
    # one prefill point: a line through the origin
    one = profile_document("u", "m", PREFILL_POINTS[-1:], DECODE_POINTS, 32)
    assert (one["prefill"]["fixed_s"], one["prefill"]["per_token_s"]) == (
        0.0, pytest.approx((0.03 + 2e-4 * 1024) / 1024))


def test_every_field_round_trips(tmp_path: Path) -> None:
    assert InstanceProfile.load(write(tmp_path, ODD.to_dict())) == ODD
    assert InstanceProfile.from_dict({}) == InstanceProfile()


def test_older_spellings_read_the_same() -> None:
    # the autoscaler's former profile fields (as the e2e tests write them) and the
    # simulator's former calibration fields
    old = InstanceProfile.from_dict({
        "prefill": {"s_per_token": 3e-4, "overhead_s": 0.03, "kv_s_per_token": 7e-6},
        "decode": {"step_base_s": 0.02, "step_per_seq_s": 3e-4, "max_seqs": 64}})
    new = InstanceProfile.from_dict({
        "prefill": {"per_token_s": 3e-4, "overhead_s": 0.03},
        "decode": {"step_s": 0.02, "per_seq_s": 3e-4, "max_running": 64,
                   "kv_transfer_s_per_token": 7e-6}})
    assert old == new
    assert (new.prefill.per_token_s, new.decode.max_running) == (3e-4, 64)


@pytest.mark.parametrize(("doc", "match"), [
    ({"prefill": {"tokens_per_s": 1}}, r"unknown prefill keys \['tokens_per_s'\]; allowed: "),
    ({"decode": {"step_s": "fast"}}, r"decode.step_s: expected a number, got 'fast'"),
    ({"decode": {"step_s": True}}, "expected a number"),
    ({"prefill": {"per_token_s": -1e-4}}, r"prefill.per_token_s: expected a time >= 0"),
    ({"decode": {"max_running": 2.5}}, r"decode.max_running: expected a whole number >= 1"),
    ({"prefill": {"cache_blocks": 0}}, "expected a whole number >= 1"),
    ({"decode": {"max_running": float("inf")}}, "expected a whole number >= 1"),
    ({"decode": {"step_s": float("nan")}}, "expected a time >= 0"),
    ({"schema": "other/2"}, "schema 'other/2'; allowed: pdserve.bench.profile/1"),
    ({"prefil": {}}, r"unknown keys \['prefil'\]"),
    ({"decode": []}, "decode must be an object"),
    ([1, 2], "expected a JSON object"),
    ({"decode": {"points": [{"batch": 1}]}}, "decode points must be a list of"),
    ({"decode": {"points": DECODE_POINTS, "step_s": 0.01}}, "both points and step_s"),
    ({"decode": {"step_s": 0.01, "step_base_s": 0.02}}, "gives step_s twice"),
    ({"prefill": {"kv_s_per_token": 1e-6}, "decode": {"kv_transfer_s_per_token": 1e-6}},
     "KV transfer given twice"),
])
def test_bad_profile_names_file_key_and_allowed(tmp_path: Path, doc: Any, match: str) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError, match=match) as err:
        InstanceProfile.load(path)
    assert str(path) in str(err.value)


def test_unreadable_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        InstanceProfile.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        InstanceProfile.load(tmp_path / "missing.json")


@pytest.mark.parametrize(("uncached", "cached", "batch", "ctx"),
                         [(0, 0, 1, 0), (1000, 0, 8, 8000), (300, 700, 200, 250_000)])
def test_formulas_both_callers_computed(uncached: int, cached: int, batch: int, ctx: int) -> None:
    p, d = ODD.prefill, ODD.decode
    # the simulator's batch and step times
    assert p.batch_s(uncached, cached) == pytest.approx(
        p.overhead_s + p.per_token_s * uncached + p.cached_token_s * cached)
    assert d.step_time_s(batch, ctx) == pytest.approx(
        d.step_s + d.per_seq_s * batch + d.per_ctx_token_s * ctx)
    # the planner's: one request of ``uncached`` tokens; a decode step at ``ctx / batch``
    # tokens per sequence
    pm, dm = capacity_models(ODD, ctx / batch)
    assert pm.request_s(uncached) == pytest.approx(p.overhead_s + uncached * p.per_token_s)
    assert pm.kv_s_per_token == d.kv_transfer_s_per_token
    assert dm.step_s(batch) == pytest.approx(d.step_time_s(batch, ctx))
    assert dm.max_seqs == d.max_running
    # scaling: every time, in both
    slow = ODD.scaled(2.0)
    assert slow.prefill.batch_s(uncached, cached) == pytest.approx(2 * p.batch_s(uncached, cached))
    assert slow.decode.step_time_s(batch, ctx) == pytest.approx(2 * d.step_time_s(batch, ctx))
    assert slow.decode.kv_transfer_s_per_token == pytest.approx(2 * d.kv_transfer_s_per_token)
    assert pm.scaled(2.0).request_s(uncached) == pytest.approx(2 * pm.request_s(uncached))
    assert dm.scaled(2.0).step_s(batch) == pytest.approx(2 * dm.step_s(batch))


def test_fit_line() -> None:
    assert fit_line([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(2, 4.0)]) == (4.0, 0.0)
    with pytest.raises(ValueError, match="no points"):
        fit_line([])


def test_the_planner_plans_with_the_profile_the_simulator_charges() -> None:
    """A lone request's simulated TTFT is the capacity model's prefill + handoff, and the
    planner ``make_controller`` builds holds the simulator's profile (times its bias)."""
    n = 900
    req = SimRequest(index=0, arrival_s=0.0, prompt_tokens=n, output_tokens=1,
                     block_hashes=tuple(range(n // 16)))
    res = simulate([req], create_prefill_policy("round_robin"), 1, 1, ODD.prefill, ODD.decode)
    pm, dm = capacity_models(ODD, context_tokens=n)
    first_step = dm.step_s(1)
    assert res.ttft_s == [pytest.approx(pm.with_handoff(n, first_step).ttft_s(n, 0.0))]
    assert pm.with_handoff(n, first_step).ttft_s(n, 0.0) > pm.ttft_s(n, 0.0)  # handoff counted

    for bias in (1.0, 0.5):
        ctl = make_controller(AutoscaleSettings("planner", 4, 4, profile_bias=bias), 2.0, 0.1,
                              ODD, n)
        assert isinstance(ctl, PlannerController)
        planner = ctl.planner
        assert planner.prefill_model == PrefillModel(ODD.scaled(bias))
        assert planner.decode_model == DecodeModel(ODD.scaled(bias), n)


def test_autoscale_sim_runs_on_the_profile_it_is_given() -> None:
    """``bench.autoscale_sim.run`` simulates with the profile passed (a slower one gives a
    longer TTFT)."""
    reqs = [SimRequest(index=i, arrival_s=0.1 * i, prompt_tokens=400, output_tokens=4,
                       block_hashes=tuple(range(i * 100, i * 100 + 25)))
            for i in range(20)]
    settings = AutoscaleSettings("static", 2, 2)
    fast = run(reqs, "round_robin", settings, 2.0, 0.1, InstanceProfile())
    slow = run(reqs, "round_robin", settings, 2.0, 0.1, InstanceProfile().scaled(3.0))
    assert statistics.fmean(slow.ttft_s) > 2.5 * statistics.fmean(fast.ttft_s)


def test_autoscale_sim_rebalances_the_policies_that_name_an_alternate() -> None:
    """The TTFT SLO is the rebalance threshold of every policy; the simulator moves queued
    requests only for a policy naming an alternate candidate (DualMap here)."""
    reqs = make_trace(60.0, 45.0, seed=0)  # enough that queues pass the SLO
    static = AutoscaleSettings("static", 3, 3)
    assert run(reqs, "dualmap", static, 1.0, 0.1).migrations > 0
    assert run(reqs, "round_robin", static, 1.0, 0.1).migrations == 0


def test_the_autoscaler_service_plans_with_its_profile_file(tmp_path: Path) -> None:
    """``pdserve autoscale --profile`` reads the same format with the same reader (the e2e
    tests' older spellings included); without one it plans with the default instance."""
    from router.autoscale.actuators import RedisActuator
    from router.autoscale.service import Autoscaler, AutoscalerSettings

    url = "redis://127.0.0.1:9/0"  # no connection is made: the clients connect on first use
    path = write(tmp_path, {"prefill": {"s_per_token": 1e-6, "overhead_s": 0.001},
                            "decode": {"step_base_s": 0.02, "step_per_seq_s": 0.049}})
    for profile, expected in ((str(path), InstanceProfile.load(path)),
                              (None, InstanceProfile())):
        planner = Autoscaler(AutoscalerSettings(url, "http://127.0.0.1:9", profile=profile),
                             RedisActuator(url)).planner
        assert (planner.prefill_model, planner.decode_model) == capacity_models(expected)
    assert InstanceProfile.load(path).decode.step_s == 0.02  # not the default: a real check
