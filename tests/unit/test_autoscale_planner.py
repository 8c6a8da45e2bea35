"""Autoscaling planner math and guards, against literal numbers."""

from __future__ import annotations

import math
from typing import Any

import pytest

from router.autoscale.capacity import DecodeModel, PrefillModel
from router.autoscale.planner import Observation, Planner, PlannerConfig
from router.autoscale.predictors import EwmaPredictor, HoltPredictor, LastValuePredictor
from router.autoscale.profile import DecodePerf, InstanceProfile, PrefillPerf
from router.autoscale.threshold import ThresholdAutoscaler


def prefill_model(per_token_s: float, overhead_s: float, **kw: float) -> PrefillModel:
    """A prefill capacity model of these service times, with no KV transfer."""
    perf = PrefillPerf(overhead_s=overhead_s, per_token_s=per_token_s)
    return PrefillModel(InstanceProfile(perf, DecodePerf(kv_transfer_s_per_token=0.0)), **kw)


def decode_model(step_s: float, per_seq_s: float) -> DecodeModel:
    """A decode capacity model stepping in ``step_s + per_seq_s * batch``."""
    return DecodeModel(InstanceProfile(decode=DecodePerf(step_s=step_s, per_seq_s=per_seq_s)))


PREFILL = prefill_model(per_token_s=1e-4, overhead_s=0.0)
DECODE = decode_model(step_s=0.01, per_seq_s=0.001)


def test_prefill_capacity_from_queue_model() -> None:
    # M/D/1 (variability 0.5, DistServe): D = 0.1 s; rho_max = 2 * (1 - 0.1) / (2 - 0.1)
    md1 = prefill_model(per_token_s=1e-4, overhead_s=0.0, variability=0.5)
    assert md1.tokens_per_s(1000, 1.0) == pytest.approx(9473.684, rel=1e-6)
    assert md1.mean_ttft_s(1000, 0.5 / 1e-4) == pytest.approx(0.1 + 0.5 * 0.1 / 1.0)
    # default variability 1.0: rho / (1 - rho) <= (1 - 0.1) / 0.1 -> rho = 0.9
    assert PREFILL.tokens_per_s(1000, 1.0) == pytest.approx(9000.0)
    assert PREFILL.tokens_per_s(20_000, 1.0) == 0.0  # one request alone breaks the SLO
    # latency outside the queue shrinks the budget: 1.0 - 0.5 -> (0.5 - 0.1) / 0.1 = 4 -> 0.8
    assert prefill_model(1e-4, 0.0, latency_s=0.5).tokens_per_s(1000, 1.0) == pytest.approx(8000)
    # the p90 at capacity sits on the SLO; no wait counts while rho <= 1 - q
    cap90 = PREFILL.tokens_per_s(1000, 1.0, quantile=0.9)
    assert PREFILL.ttft_s(1000, cap90, 0.9) == pytest.approx(1.0, rel=1e-6)
    assert cap90 < PREFILL.tokens_per_s(1000, 1.0)  # a tail target is stricter than the mean
    assert PREFILL.ttft_s(1000, 0.05 / 1e-4, 0.9) == pytest.approx(0.1)
    # exponential tail: p90 wait = W / rho * ln(rho / 0.1), W = rho / (1 - rho) * D
    assert PREFILL.ttft_s(1000, 0.5 / 1e-4, 0.9) == pytest.approx(0.1 + 0.2 * math.log(5))
    assert PREFILL.queue_wait_s(1000, 0.5 / 1e-4, 0.9) == pytest.approx(0.2 * math.log(5))
    # a longer p90 prompt adds its own prefill time to the quantile (not to the queue)
    assert PREFILL.ttft_s(1000, 0.5 / 1e-4, 0.9, tail_isl=3000) == pytest.approx(
        0.3 + 0.2 * math.log(5))
    assert PREFILL.tokens_per_s(1000, 1.0, 0.9, tail_isl=3000) < cap90
    # burstier traffic (variability 3) queues 3x as long: less capacity at the same SLO
    assert PREFILL.with_variability(3.0).queue_wait_s(1000, 5000, 0.9) == pytest.approx(
        3 * 0.2 * math.log(5))
    assert PREFILL.scaled(2.0).request_s(1000) == pytest.approx(0.2)


def test_decode_capacity_from_step_time() -> None:
    assert DECODE.max_batch(0.1) == 90  # (0.1 - 0.01) / 0.001
    assert DECODE.max_batch(1.0) == 256  # KV room caps it
    assert DECODE.max_batch(0.005) == 0
    assert DECODE.tokens_per_s(0.1) == pytest.approx(900.0)  # 90 sequences / 0.1 s steps
    assert DECODE.tpot_s(900.0) == pytest.approx(0.1)  # and back: the batch that delivers it
    assert DECODE.tpot_s(450.0) == pytest.approx(0.01 + 0.001 * 4.5 / 0.55)
    assert DECODE.tpot_s(5000.0) == DECODE.step_s(256)  # beyond its room: the largest batch


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


def obs(now: float, rate: float, prefill: int = 1, decode: int = 1, **kw: Any) -> Observation:
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
    # Prefill: 30 req/s x 1000 tokens = 30k tokens/s; one instance keeps its p90 TTFT within
    # 1 s up to 7728 tokens/s, x 0.8 usable = 6182 -> ceil = 5.
    # Decode: 30 req/s x 100 tokens = 3000 tokens/s; 90 sequences / 0.1 s = 900 tokens/s per
    # instance within the TPOT SLO, x 0.8 = 720 -> 5.
    (p, d), = run(planner(), [30.0])
    assert (p, d) == (2, 2)  # at most 2x per interval from 1 replica
    assert run(planner(), [30.0] * 3)[-1] == (5, 5)


def test_steady_rate_does_not_flap() -> None:
    history = run(planner(), [30.0] * 40)
    assert len(set(history[5:])) == 1


def test_bounds_hold() -> None:
    assert run(planner(max_replicas=3), [500.0] * 5)[-1] == (3, 3)
    assert run(planner(), [0.0] * 20, start=(4, 4))[-1] == (1, 1)


def test_scale_down_waits_for_cooldown_and_goes_one_at_a_time() -> None:
    p = planner()
    up = run(p, [30.0] * 3)
    assert up[-1] == (5, 5)
    downs = []
    pp, dd = up[-1]
    for i in range(3, 12):
        dp, dd_ = p.plan(obs(10.0 * i, 1.0, pp, dd))
        downs.append((dp.desired, dp.reason, dd_.desired, dd_.reason))
        pp, dd = dp.desired, dd_.desired
    # Both pools last changed at t=20 (4 -> 5); with a 30 s cooldown they may shrink at t=50,
    # 80, 110, one instance each time.
    expected = ["cooldown", "cooldown", "scale_down"] * 3
    sizes = [5, 5, 4, 4, 4, 3, 3, 3, 2]
    assert downs == [(n, r, n, r) for n, r in zip(sizes, expected, strict=True)]


def test_no_scale_down_while_an_instance_is_starting() -> None:
    p = Planner(PlannerConfig(predictor="last", scale_down_cooldown_s=0.0), PREFILL, DECODE)
    dp, _ = p.plan(obs(0.0, 1.0, prefill=3, prefill_starting=1))
    assert (dp.desired, dp.reason) == (3, "cooldown")  # a scale-up is still landing
    dp, _ = p.plan(obs(10.0, 1.0, prefill=3))
    assert (dp.desired, dp.reason) == (2, "scale_down")


def test_no_scale_down_while_requests_wait_in_the_pool() -> None:
    """Long answers arrive seldom: intervals with no arrival read as no load while every
    engine still has a queue. A queue holds the pool; with it empty the same state shrinks."""
    p = Planner(PlannerConfig(predictor="last", scale_down_cooldown_s=0.0), PREFILL, DECODE)
    dp, dd = p.plan(obs(0.0, 1.0, prefill=3, decode=3, prefill_queued=0.0, decode_queued=2.0))
    assert (dd.desired, dd.reason) == (3, "queued")
    assert (dp.desired, dp.reason) == (2, "scale_down")  # the other pool's queue is empty
    _, dd = p.plan(obs(10.0, 1.0, prefill=2, decode=3, decode_queued=0.0))
    assert (dd.desired, dd.reason) == (2, "scale_down")
    _, dd = p.plan(obs(20.0, 1.0, prefill=2, decode=2))  # unknown queue: no hold
    assert (dd.desired, dd.reason) == (1, "scale_down")


def test_forecast_looks_a_worker_start_ahead() -> None:
    # a ramp of +5 req/s per 10 s interval: with a 30 s horizon the planner sizes for the rate
    # three intervals on, without it (horizon 0) for the next one
    sizes = {}
    for horizon in (0.0, 30.0):
        p = Planner(PlannerConfig(predictor="holt", forecast_horizon_s=horizon,
                                  correction_alpha=0.0, max_scale_up_factor=100.0),
                    PREFILL, DECODE)
        for i, rate in enumerate([5.0, 10.0, 15.0, 20.0, 25.0, 30.0]):
            dp, _ = p.plan(obs(10.0 * i, rate, prefill=8))
        sizes[horizon] = dp.load
    assert sizes[30.0] > sizes[0.0] * 1.2


def test_panic_adds_capacity_on_slo_breach_and_holds_scale_down() -> None:
    p = planner(ttft_slo_s=1.0)
    dp, _ = p.plan(obs(0.0, 1.0, prefill=2, decode=1, ttft_p90_s=2.0))
    assert (dp.desired, dp.reason) == (3, "panic")
    dp, _ = p.plan(obs(40.0, 0.1, prefill=3, decode=1))
    assert dp.desired == 3 and dp.reason == "cooldown"  # held for panic_hold_s (60 s)


def _fitted_run(truth: PrefillModel, rate: float, alpha: float = 0.3
                ) -> tuple[Planner, int]:
    """Plan against a world whose prefill instances behave like ``truth`` (the planner's
    profile is ``PREFILL``); return the planner and the replicas it settles on."""
    # panic off: the fits alone must find the size
    p = Planner(PlannerConfig(predictor="last", correction_alpha=alpha, panic_factor=1e9),
                PREFILL, DECODE)
    replicas = 1
    for i in range(60):
        # the TTFT the router sees holds the first decode step (obs: a 0.1 s TPOT)
        observed = truth.ttft_s(1000, rate * 1000 / replicas, 0.9) + 0.1
        dp, _ = p.plan(obs(10.0 * i, rate, prefill=replicas, decode=8, ttft_p90_s=observed))
        replicas = dp.desired
    return p, replicas


def test_light_load_fits_the_service_time() -> None:
    # at 500 tokens/s nothing queues: the p90 TTFT is the prefill itself, 1.6x the profile's
    p, _ = _fitted_run(PREFILL.scaled(1.6), rate=0.5)
    assert p.correction("prefill") == pytest.approx(1.6, rel=0.02)
    assert p.variability == 1.0


def test_fits_converge_on_a_biased_capacity_model() -> None:
    for truth in (PREFILL.scaled(1.6), PREFILL.with_variability(3.0)):
        p, replicas = _fitted_run(truth, rate=20.0)
        per_instance = 20 * 1000 / replicas
        # the fitted model predicts the p90 the world shows at the size it chose, which meets
        # the SLO
        assert p.prefill().ttft_s(1000, per_instance, 0.9) == pytest.approx(
            truth.ttft_s(1000, per_instance, 0.9), rel=0.05)
        assert truth.ttft_s(1000, per_instance, 0.9) <= 1.0
        # negative control: the optimistic profile alone under-provisions
        q, uncorrected = _fitted_run(truth, rate=20.0, alpha=0.0)
        assert q.correction("prefill") == 1.0 and uncorrected < replicas
        assert truth.ttft_s(1000, 20 * 1000 / uncorrected, 0.9) > 1.0
    # burstiness is a queue's property: it is fitted as variability, not as a slower prefill
    p, _ = _fitted_run(PREFILL.with_variability(3.0), rate=20.0)
    assert p.variability == pytest.approx(3.0, rel=0.02) and p.correction("prefill") == 1.0


def test_a_pessimistic_profile_is_corrected_down() -> None:
    _, fewer = _fitted_run(PREFILL.scaled(0.7), rate=60.0)
    assert fewer < _fitted_run(PREFILL.scaled(0.7), rate=60.0, alpha=0.0)[1]
    assert PREFILL.scaled(0.7).ttft_s(1000, 60 * 1000 / fewer, 0.9) <= 1.0


def test_decode_correction_converges() -> None:
    truth = DECODE.scaled(1.5)
    p = Planner(PlannerConfig(predictor="last", correction_alpha=0.3, panic_factor=1e9),
                PREFILL, DECODE)
    d = 1
    for i in range(40):
        per_instance = 30.0 * 100 / d
        _, dd = p.plan(obs(10.0 * i, 30.0, prefill=8, decode=d,
                           tpot_mean_s=truth.tpot_s(per_instance)))
        d = dd.desired
    assert p.correction("decode") == pytest.approx(1.5, rel=0.02)
    assert truth.tpot_s(30.0 * 100 / d) <= 0.1


def test_threshold_autoscaler_is_hpa_like() -> None:
    hpa = ThresholdAutoscaler(target=0.5, tolerance=0.1, scale_down_cooldown_s=60)
    assert hpa.desired(0, 2, 0.52) == 2          # within tolerance
    assert hpa.desired(0, 2, 1.0) == 4           # ceil(2 * 1.0 / 0.5)
    assert hpa.desired(30, 4, 0.1) == 4          # scale-down waits for the window
    assert hpa.desired(61, 4, 0.1) == 1          # ceil(4 * 0.2)


def test_idle_pool_shrinks_even_when_the_model_rates_capacity_at_zero() -> None:
    slow = decode_model(step_s=0.5, per_seq_s=0.1)  # cannot meet a 0.1 s TPOT at all
    p = Planner(PlannerConfig(predictor="last", scale_down_cooldown_s=0.0, max_replicas=2),
                PREFILL, slow)
    _, dd = p.plan(obs(0.0, 5.0, decode=2))
    assert dd.desired == 2 and dd.capacity_per_instance == 0  # load with no capacity: hold max
    _, dd = p.plan(obs(10.0, 0.0, decode=2))
    assert (dd.desired, dd.reason) == (1, "scale_down")


def test_one_empty_interval_in_steady_traffic_does_not_shrink_the_pool() -> None:
    """Arrivals lumped into some intervals and not others (short intervals, few requests) must
    not flap the pool: an interval without an arrival is planned from the remembered level like
    any other, and a scale-down takes the largest size asked for within the cooldown, so the
    pool holds through the empty intervals and there is no scale-up right after."""
    p = Planner(PlannerConfig(predictor="last", correction_alpha=0.0,
                              scale_down_cooldown_s=30.0, burst_quantile=0.0), PREFILL, DECODE)
    sizes = run(p, [12.0, 12.0, 12.0, 0.0, 12.0, 0.0, 12.0, 0.0, 12.0], start=(1, 2))
    assert {d for _, d in sizes[1:]} == {sizes[1][1]}, sizes
    assert sizes[1][1] >= 2  # the traffic needs more than one decode instance (not vacuous)


def test_stopped_traffic_still_shrinks_the_pool_to_its_minimum() -> None:
    """Once arrivals stop, the remembered level decays and the pool steps down to one."""
    p = Planner(PlannerConfig(predictor="last", correction_alpha=0.0,
                              scale_down_cooldown_s=30.0, burst_quantile=0.0), PREFILL, DECODE)
    sizes = run(p, [12.0] * 3 + [0.0] * 12, start=(1, 2))
    assert sizes[2][1] >= 2 and sizes[-1] == (1, 1), sizes
    downs = [b - a for (_, a), (_, b) in zip(sizes, sizes[1:], strict=False)]
    assert min(downs) >= -1  # one instance at a time (max_scale_down_step)


def test_burst_headroom_learns_overshoots_from_history() -> None:
    from router.autoscale.predictors import BurstHeadroom

    h = BurstHeadroom(window=10, cap=4.0)
    # forecast 10 throughout; the rate sits at 10, then jumps to 30 for two intervals
    for rate in (10, 10, 10, 30, 30, 10):
        h.observe(rate, 10.0)
    # horizon 2: mean of the next two rates over the forecast, with the rate that followed
    assert h.overshoots(2) == [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0), (2.0, 20.0)]
    # rate-weighted: the burst intervals carry 50 of the 80 requests that followed
    assert h.factor(2, 0.5) == 2.0
    assert h.factor(2, 0.9) == 3.0
    assert h.factor(2, 0.0) == 1.0  # off
    assert h.rate_quantile(2, 0.9) == 30.0
    assert h.factor(1, 1.0) == 3.0  # one interval ahead: 30 / 10
    # the window forgets: ten quiet intervals later nothing of the burst is left
    for _ in range(10):
        h.observe(10.0, 10.0)
    assert h.factor(2, 0.9) == 1.0
    # a smooth series learns no headroom (negative control for the burst above)
    smooth = BurstHeadroom(window=30)
    for _ in range(30):
        smooth.observe(20.0, 20.0)
    assert smooth.factor(4, 0.9) == 1.0


def test_planner_keeps_capacity_for_bursts_it_has_seen() -> None:
    """Quiet at 2 req/s with a 10x burst every 2 minutes: after the first burst the planner
    holds more prefill between bursts than one without headroom (burst_quantile 0)."""
    quiet: dict[float, int] = {}
    for q in (0.9, 0.0):
        p = planner(burst_quantile=q, max_scale_up_factor=100.0)
        size = 1
        for i in range(66):
            rate = 20.0 if i % 12 in (6, 7, 8) else 2.0
            dp, _ = p.plan(obs(10.0 * i, rate, prefill=size))
            size = dp.desired
        quiet[q] = size  # after i = 65: what serves the burst arriving in the next interval
    # a 20 req/s burst needs 4 instances (20k tokens/s over 6182 usable per instance)
    assert quiet[0.0] == 1
    assert quiet[0.9] >= 4


def test_cold_headroom_holds_capacity_before_any_burst_and_decays() -> None:
    """A quiet start at 2 req/s: with a 6x cold-start headroom over 300 s the planner holds
    the pool a 12 req/s step needs (12k tokens/s over 6182 usable per instance: 2) from its
    first decisions, and is back at one instance once the 300 s have passed; without it
    (cold_headroom 1, the negative control) it never leaves one instance."""
    sizes: dict[float, list[int]] = {}
    for cold in (6.0, 1.0):
        p = planner(cold_headroom=cold, cold_s=300.0, max_scale_up_factor=100.0,
                    burst_quantile=0.0)
        sizes[cold] = [pd for pd, _ in run(p, [2.0] * 45)]
    assert sizes[1.0] == [1] * 45
    assert min(sizes[6.0][:10]) >= 2  # the first 100 s: ready for a 6x step
    assert sizes[6.0][-1] == 1  # decayed: 440 s in, the cold headroom is gone
    with pytest.raises(ValueError):
        PlannerConfig(cold_headroom=0.5)


def test_cold_reference_does_not_multiply_a_smooth_rise() -> None:
    """A quiet start at 2 req/s rising by 0.5 req/s per interval (no interval doubles): with
    ``cold_reference_s`` the cold headroom multiplies the first 30 s's rate (2.5 req/s), so
    the pool stays below the one that multiplies the rising level (the negative control,
    ``cold_reference_s`` 0), yet never below what the level itself needs."""
    rates = [2.0 + 0.5 * i for i in range(20)]
    sizes: dict[float, list[int]] = {}
    for ref in (30.0, 0.0):
        p = planner(cold_headroom=6.0, cold_s=300.0, cold_reference_s=ref,
                    max_scale_up_factor=100.0, burst_quantile=0.0)
        sizes[ref] = [pd for pd, _ in run(p, rates)]
    assert sizes[30.0][:3] == sizes[0.0][:3]  # within the reference: the same plan
    assert max(sizes[30.0]) < max(sizes[0.0])
    # 11.5 req/s x 1000 tokens at the end, over 6182 usable per instance: 2 at least
    assert sizes[30.0][-1] >= 2
    assert all(a <= b for a, b in zip(sizes[30.0], sizes[0.0], strict=True))


def test_cold_reference_follows_a_step() -> None:
    """Quiet at 2 req/s, then a step to 12 req/s within the cold period: the interval that
    doubles over the forecast level ends the reference, and the cold headroom multiplies the
    stepped level as without one; with ``cold_burst_factor`` 100 (the negative control) no
    interval counts as a step and the pool stays sized on the quiet start."""
    rates = [2.0] * 6 + [12.0] * 6
    sizes: dict[str, list[int]] = {}
    for name, kw in (("none", {"cold_reference_s": 0.0}),
                     ("step", {"cold_reference_s": 30.0, "cold_burst_factor": 2.0}),
                     ("never", {"cold_reference_s": 30.0, "cold_burst_factor": 100.0})):
        p = planner(cold_headroom=6.0, cold_s=300.0, max_scale_up_factor=100.0,
                    burst_quantile=0.0, max_replicas=64, **kw)
        sizes[name] = [pd for pd, _ in run(p, rates)]
    assert sizes["step"][6:] == sizes["none"][6:]
    assert max(sizes["never"][6:]) < max(sizes["step"][6:])
    with pytest.raises(ValueError):
        PlannerConfig(cold_burst_factor=1.0)
    with pytest.raises(ValueError):
        PlannerConfig(cold_reference_s=-1.0)


def test_decode_target_utilisation_overrides_the_shared_one_for_decode_only() -> None:
    """30 req/s x 100 output tokens = 3000 tokens/s over 900 per decode instance: 5 at the
    shared 0.8 (test_replicas_follow_the_formula), 4 at a decode target of 1.0; prefill stays
    at 5. Unset (the negative control), both pools keep 0.8."""
    assert run(planner(decode_target_utilisation=1.0), [30.0] * 3)[-1] == (5, 4)
    assert run(planner(), [30.0] * 3)[-1] == (5, 5)
    with pytest.raises(ValueError):
        PlannerConfig(decode_target_utilisation=1.5)
