"""Autoscaling planner math and guards, against literal numbers."""

from __future__ import annotations

import json
import math

import pytest

from router.autoscale.capacity import DecodeModel, PrefillModel
from router.autoscale.planner import Observation, Planner, PlannerConfig
from router.autoscale.predictors import EwmaPredictor, HoltPredictor, LastValuePredictor
from router.autoscale.threshold import ThresholdAutoscaler

PREFILL = PrefillModel(s_per_token=1e-4, overhead_s=0.0)
DECODE = DecodeModel(step_base_s=0.01, step_per_seq_s=0.001, max_seqs=256)


def test_prefill_capacity_from_md1_queue() -> None:
    # D = 0.1 s; rho_max = 2 * (1 - 0.1) / (2 - 0.1) = 0.947368...; capacity = rho_max / 1e-4.
    assert PREFILL.tokens_per_s(1000, 1.0) == pytest.approx(9473.684, rel=1e-6)
    assert PREFILL.tokens_per_s(20_000, 1.0) == 0.0  # one request alone breaks the SLO
    rho = 0.5
    assert PREFILL.mean_ttft_s(1000, rho / 1e-4) == pytest.approx(0.1 + 0.5 * 0.1 / 1.0)


def test_decode_capacity_from_step_time() -> None:
    assert DECODE.max_batch(0.1) == 90  # (0.1 - 0.01) / 0.001
    assert DECODE.max_batch(1.0) == 256  # KV room caps it
    assert DECODE.max_batch(0.005) == 0


def test_predictors() -> None:
    last, ewma, holt = LastValuePredictor(), EwmaPredictor(0.5), HoltPredictor(0.5, 0.5)
    for v in (10, 20, 30, 40):
        for p in (last, ewma, holt):
            p.observe(v)
    assert last.predict() == 40
    assert ewma.predict() == pytest.approx(((10 * 0.5 + 20 * 0.5) * 0.5 + 30 * 0.5) * 0.5 + 20)
    assert holt.predict() > ewma.predict()  # follows the ramp
    with pytest.raises(ValueError):
        EwmaPredictor(0.0)


def obs(now: float, rate: float, prefill: int = 1, decode: int = 1, **kw: float) -> Observation:
    kw.setdefault("tpot_mean_s", 0.1)
    return Observation(now_s=now, interval_s=10.0, arrivals=round(rate * 10), mean_isl=1000,
                       mean_osl=100, prefill_replicas=prefill, decode_replicas=decode, **kw)


def run(planner: Planner, rates: list[float], start: tuple[int, int] = (1, 1)
        ) -> list[tuple[int, int]]:
    p, d = start
    out = []
    for i, rate in enumerate(rates):
        dp, dd = planner.plan(obs(10.0 * i, rate, p, d))
        p, d = dp.desired, dd.desired
        out.append((p, d))
    return out


def planner(**kw: object) -> Planner:
    kw.setdefault("correction_alpha", 0.0)
    cfg = PlannerConfig(predictor="last", scale_down_cooldown_s=30.0, **kw)  # type: ignore[arg-type]
    return Planner(cfg, PREFILL, DECODE)


def test_replicas_follow_the_formula() -> None:
    # 30 req/s x 1000 tokens = 30k tokens/s; one instance: 9473.7 x 0.8 usable -> ceil = 4.
    # Decode (Little): 30 req/s x 100 tokens x 0.1 s observed per token = 300 sequences;
    # 90 per instance x 0.8 -> 5.
    (p, d), = run(planner(), [30.0])
    assert p == min(4, 2) and d == 2  # at most 2x per interval from 1 replica
    assert run(planner(), [30.0] * 3)[-1] == (4, 5)


def test_steady_rate_does_not_flap() -> None:
    history = run(planner(), [30.0] * 40)
    assert len(set(history[5:])) == 1


def test_bounds_hold() -> None:
    assert run(planner(max_replicas=3), [500.0] * 5)[-1] == (3, 3)
    assert run(planner(), [0.0] * 20, start=(4, 4))[-1] == (1, 1)


def test_scale_down_waits_for_cooldown_and_goes_one_at_a_time() -> None:
    p = planner()
    up = run(p, [30.0] * 3)
    assert up[-1] == (4, 5)
    downs = []
    pp, dd = up[-1]
    for i in range(3, 12):
        dp, dd_ = p.plan(obs(10.0 * i, 1.0, pp, dd))
        downs.append((dp.desired, dp.reason))
        pp, dd = dp.desired, dd_.desired
    # Prefill last changed at t=10 (2 -> 4); with a 30 s cooldown it may shrink at t=40, 70, 100.
    assert downs == [(4, "cooldown"), (3, "scale_down"), (3, "cooldown"), (3, "cooldown"),
                     (2, "scale_down"), (2, "cooldown"), (2, "cooldown"), (1, "scale_down"),
                     (1, "steady")]


def test_panic_adds_capacity_on_slo_breach_and_holds_scale_down() -> None:
    p = planner(ttft_slo_s=1.0)
    dp, _ = p.plan(obs(0.0, 1.0, prefill=2, decode=1, ttft_p90_s=2.0))
    assert (dp.desired, dp.reason) == (3, "panic")
    dp, _ = p.plan(obs(40.0, 0.1, prefill=3, decode=1))
    assert dp.desired == 3 and dp.reason == "cooldown"  # held for panic_hold_s (60 s)


def test_correction_converges_on_a_biased_capacity_model() -> None:
    truth = PrefillModel(s_per_token=2e-4, overhead_s=0.0)  # the profile is 2x optimistic
    p = Planner(PlannerConfig(predictor="last", correction_alpha=0.3), PREFILL, DECODE)
    replicas = 4
    for i in range(40):
        per_instance = 15.0 * 1000 / replicas
        observed = truth.mean_ttft_s(1000, per_instance)
        dp, _ = p.plan(obs(10.0 * i, 15.0, prefill=replicas, ttft_mean_s=observed))
        replicas = dp.desired
    # The correction is an observed/predicted TTFT ratio: with the true model it explains
    # the gap (about 2x service time plus the extra queueing), and capacity shrank with it.
    assert 2.0 <= p.correction("prefill") <= 4.0
    expected = math.ceil(15 * 1000 / (PREFILL.tokens_per_s(1000, 1.0)
                                      / p.correction("prefill") * 0.8))
    assert replicas == expected
    assert truth.mean_ttft_s(1000, 15 * 1000 / replicas) <= 1.0  # SLO met with the corrected size


def test_threshold_autoscaler_is_hpa_like() -> None:
    hpa = ThresholdAutoscaler(target=0.5, tolerance=0.1, scale_down_cooldown_s=60)
    assert hpa.desired(0, 2, 0.52) == 2          # within tolerance
    assert hpa.desired(0, 2, 1.0) == 4           # ceil(2 * 1.0 / 0.5)
    assert hpa.desired(30, 4, 0.1) == 4          # scale-down waits for the window
    assert hpa.desired(61, 4, 0.1) == 1          # ceil(4 * 0.2)


def test_idle_pool_shrinks_even_when_the_model_rates_capacity_at_zero() -> None:
    slow = DecodeModel(step_base_s=0.5, step_per_seq_s=0.1)  # cannot meet a 0.1 s TPOT at all
    p = Planner(PlannerConfig(predictor="last", scale_down_cooldown_s=0.0, max_replicas=2),
                PREFILL, slow)
    _, dd = p.plan(obs(0.0, 5.0, decode=2))
    assert dd.desired == 2 and dd.capacity_per_instance == 0  # load with no capacity: hold max
    _, dd = p.plan(obs(10.0, 0.0, decode=2))
    assert (dd.desired, dd.reason) == (1, "scale_down")


def test_profile_from_bench_profile_schema(tmp_path) -> None:  # noqa: ANN001
    from router.autoscale.capacity import load_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({
        "schema": "pdserve.bench.profile/1",
        "prefill": {"fixed_s": 0.02, "per_token_s": 2e-4, "points": []},
        "decode": {"points": [{"batch_size": b, "step_s": 0.01 + 0.001 * b} for b in (1, 3, 5)]}}))
    prefill, decode = load_profile(path)
    assert (prefill.s_per_token, prefill.overhead_s) == (2e-4, 0.02)
    assert decode.step_base_s == pytest.approx(0.010)
    assert decode.step_per_seq_s == pytest.approx(0.001)
