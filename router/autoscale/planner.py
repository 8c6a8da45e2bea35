"""SLO-driven planner: observations in, desired replica counts per pool out (pure).

Each interval the planner forecasts the arrival rate and the mean uncached input and output
lengths, turns them into load (prefill: uncached tokens/s; decode: output tokens/s), and
divides by what one instance sustains within its SLO (``capacity.py``).
The load is the larger of the next interval's forecast and the forecast ``forecast_horizon_s``
ahead (a worker's start time: an instance asked for now serves only then), times a headroom
for bursts learned from this trace's own history (``predictors.BurstHeadroom``: the
``burst_quantile`` of how far the rate overshot the forecast within a start time plus an
interval), plus any backlog (arrived, not yet prefilled) drained within ``backlog_drain_s``.
Before the trace has shown any burst, a cold-start headroom (``cold_headroom``, decaying over
``cold_s``) stands in for the learned one (with ``cold_reference_s``, on the level the planner
started at until an interval steps ``cold_burst_factor`` x above the forecast level).
The prefill model's TTFT holds the handoff to decode (KV transfer of the whole context and the
first decode step, ``capacity.PrefillModel.with_handoff``). The models are
fitted online: each interval the planner compares the latency it observed with what its model
predicts for the load each serving instance got. Prefill: a light interval (the model puts
under ``queue_share`` of the p90 TTFT in queueing) fits the service-time scale (the
``correction``; 1.0 = the profile is right), a loaded one fits the queue's variability
(burstiness of arrivals and prompt lengths, which no single-request profile measures).
Decode: the mean TPOT fits the step-time scale. Each fit is an EWMA. Then:

- scale up at once (at most ``max_scale_up_factor`` x current per interval);
- scale down ``max_scale_down_step`` instances at a time, only after ``scale_down_cooldown_s``
  since the pool last changed, to no fewer than the most any decision within that cooldown
  asked for, never while one of its instances is still starting or requests wait in its engines'
  queues (a queue says the pool is full, whatever the arrival rate says: long answers arrive
  seldom), and only if the remaining instances stay below ``safety_utilisation``;
- panic: when the observed p90 latency breaks its SLO by ``panic_factor`` while the model says
  the pool is big enough, add one instance per interval (none while one is still starting)
  and hold scale-down for ``panic_hold_s``.

Parameters (defaults) are the fields of :class:`PlannerConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from router.autoscale.capacity import DecodeModel, PrefillModel, fit_scale
from router.autoscale.predictors import BurstHeadroom, Predictor, make_predictor

Pool = Literal["prefill", "decode"]


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the planner; times in seconds."""

    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    min_replicas: int = 1
    max_replicas: int = 16
    max_prefill_replicas: int | None = None
    """Overrides ``max_replicas`` for the prefill pool."""
    max_decode_replicas: int | None = None
    """Overrides ``max_replicas`` for the decode pool."""
    slo_quantile: float = 0.9
    """Prefill is sized so this quantile of TTFT meets the SLO (the observed p90 corrects it)."""
    target_utilisation: float = 0.8
    """Plan for this fraction of an instance's SLO capacity (headroom for bursts)."""
    safety_utilisation: float = 0.6
    """Scale down only if the remaining instances would run below this fraction of capacity."""
    decode_target_utilisation: float | None = None
    """Overrides ``target_utilisation`` for the decode pool (None: the same), its
    ``safety_utilisation`` scaled by the same ratio. Decode's queue is shared (a burst shows
    as a bigger batch, not as one instance's backlog) and its tokens/s model is a step-time
    fit, so it can run closer to its capacity than prefill."""
    scale_down_cooldown_s: float = 60.0
    max_scale_up_factor: float = 2.0
    panic_factor: float = 1.5
    panic_hold_s: float = 60.0
    predictor: str = "holt"
    forecast_horizon_s: float = 30.0
    """Also plan for the load forecast this far ahead (about a worker's start time)."""
    tail_prompt: bool = True
    """Size prefill for the tail prompt's TTFT (else the mean prompt's): a long prompt's own
    prefill can take most of the SLO, and no number of instances shortens it."""
    burst_quantile: float = 0.9
    """Size for this quantile of the rate's overshoot of its forecast within a worker start
    plus an interval (0 disables the headroom)."""
    burst_window_s: float = 900.0
    """History the burst headroom is learned from."""
    max_headroom: float = 10.0
    """Cap of the burst headroom factor."""
    free_headroom: float = 2.0
    """Headroom up to this factor applies even above the highest rate seen (a ramp's
    forecast lags its rise); beyond it the plan stops at the ``burst_quantile`` of the rates
    seen (a 10x factor at a quiet level asks for the peak, not 10x the peak)."""
    cold_headroom: float = 1.0
    """Headroom before the trace has shown its bursts: the planned rate is at least the level
    times this factor, decaying linearly to 1 over ``cold_s`` from the first observation (a
    step before any history lands on the few instances of a quiet start, and their queue
    outlives the step: the instances added later do not take it). 1 disables it."""
    cold_s: float = 300.0
    cold_reference_s: float = 0.0
    """0: the cold headroom multiplies the current level. Above 0: it multiplies the mean rate
    of the first ``cold_reference_s`` observed (the level the planner started at) until the
    trace steps (``cold_burst_factor``), so a smooth rise during the cold period (a ramp, a
    day's morning) is not multiplied by it as well: that rise is no step out of a quiet start."""
    cold_burst_factor: float = 2.0
    """With ``cold_reference_s``: once an interval's rate reaches this factor times the level
    forecast before it, the trace has stepped, and the cold headroom multiplies the current
    level again for the rest of ``cold_s`` (the backlog of a step lands on the instances of
    the quiet start; sizing on the stepped level drains it)."""
    decode_headroom: bool = True
    """Apply the burst headroom to decode as well (else decode sizes for the forecast)."""
    backlog_drain_s: float = 30.0
    """Size to drain the observed backlog (arrived, not yet prefilled) within this long."""
    max_scale_down_step: int = 1
    """Instances removed per interval at most."""
    correction_alpha: float = 0.3  # 0 disables the online fits
    """EWMA weight of each interval's fitted service-time scale or variability."""
    correction_bounds: tuple[float, float] = (0.5, 2.0)
    """A profile off by more than 2x needs re-profiling, not correcting: wider bounds let the
    backlog after a burst read as a 4x-wrong model and send the pool to its maximum."""
    variability_bounds: tuple[float, float] = (0.25, 4.0)
    queue_share: float = 0.25
    """An interval whose predicted p90 TTFT is less than this share queueing fits the prefill
    service time; one with more fits the queue's variability."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if not 0 < self.safety_utilisation <= self.target_utilisation <= 1:
            raise ValueError("need 0 < safety_utilisation <= target_utilisation <= 1")
        if not 0 <= self.burst_quantile < 1 or self.max_headroom < 1:
            raise ValueError("need 0 <= burst_quantile < 1 and max_headroom >= 1")
        if self.backlog_drain_s <= 0 or self.max_scale_down_step < 1:
            raise ValueError("need backlog_drain_s > 0 and max_scale_down_step >= 1")
        if self.cold_headroom < 1 or self.cold_s < 0:
            raise ValueError("need cold_headroom >= 1 and cold_s >= 0")
        if self.cold_reference_s < 0 or self.cold_burst_factor <= 1:
            raise ValueError("need cold_reference_s >= 0 and cold_burst_factor > 1")
        if self.decode_target_utilisation is not None \
                and not 0 < self.decode_target_utilisation <= 1:
            raise ValueError("need 0 < decode_target_utilisation <= 1")


@dataclass(frozen=True)
class Observation:
    """What happened during one planning interval."""

    now_s: float
    interval_s: float
    arrivals: int
    mean_isl: float
    """Mean uncached prompt tokens per request prefilled (prefix-cache hits subtracted); 0
    when none was."""
    mean_osl: float
    """Mean output tokens per request decoded; 0 when none was."""
    prefill_replicas: int
    decode_replicas: int
    ttft_p90_s: float | None = None
    ttft_mean_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_mean_s: float | None = None
    p90_isl: float | None = None
    """90th percentile of the uncached prompt tokens per request (None: take the mean)."""
    prefill_starting: int = 0
    """Of ``prefill_replicas``, instances asked for but not serving yet."""
    decode_starting: int = 0
    mean_prompt_tokens: float | None = None
    """Mean whole prompt (cached tokens too) per request prefilled: the KV that moves to
    decode (None: take ``mean_isl``)."""
    prefilled: int | None = None
    """Requests whose prefill finished in the interval (None: unknown, no backlog term)."""
    prefill_queued: float | None = None
    """Requests waiting in the prefill engines' queues at the interval's end (None: unknown)."""
    decode_queued: float | None = None
    """Requests waiting in the decode engines' queues at the interval's end (None: unknown)."""


@dataclass(frozen=True)
class Decision:
    """Desired replicas of one pool and why."""

    pool: Pool
    current: int
    desired: int
    reason: str
    """One of: steady, scale_up, scale_down, cooldown, queued, panic, bounds."""
    load: float
    """Load sized for: forecast x headroom + backlog (prefill: uncached tokens/s; decode:
    output tokens/s)."""
    capacity_per_instance: float
    predicted_load: float = 0.0
    """The forecast load, before headroom and backlog."""
    observed_load: float = 0.0
    """The load of the interval just observed."""
    headroom: float = 1.0
    """Burst headroom factor applied to the forecast."""

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current \
            else "none"


@dataclass
class _PoolState:
    last_change_s: float = -math.inf
    asked: list[tuple[float, int]] = field(default_factory=list)
    """(time, instances needed) of the decisions within the last scale-down cooldown."""
    panic_until_s: float = -math.inf
    correction: float = 1.0


@dataclass
class Planner:
    """Stateful across intervals, but pure: time and observations are arguments."""

    config: PlannerConfig
    prefill_model: PrefillModel
    decode_model: DecodeModel
    _rate: Predictor = field(init=False)
    _isl: Predictor = field(init=False)
    _isl_tail: Predictor = field(init=False)
    _osl: Predictor = field(init=False)
    _pools: dict[str, _PoolState] = field(init=False)
    _variability: float = field(init=False)
    _burst: BurstHeadroom | None = field(init=False, default=None)
    _backlog: float = field(init=False, default=0.0)
    _ctx: Predictor = field(init=False)
    _first_s: float | None = field(init=False, default=None)
    _start_rates: list[float] = field(init=False, default_factory=list)
    _stepped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._rate = make_predictor(self.config.predictor)
        self._ctx = make_predictor("ewma")  # whole prompt tokens per request
        # the burst headroom multiplies a level, not Holt's extrapolation: after a burst the
        # trend forecasts ~0, and a quiet interval must not erase what the burst taught
        self._level = make_predictor("ewma")
        self._isl = make_predictor("ewma")
        self._isl_tail = make_predictor("ewma")  # p90 / mean uncached prompt length
        self._osl = make_predictor("ewma")
        self._pools = {"prefill": _PoolState(), "decode": _PoolState()}
        self._variability = self.prefill_model.variability

    def correction(self, pool: Pool) -> float:
        """Current service-time scale of ``pool``'s model (1.0 = the profile is right)."""
        return self._pools[pool].correction

    @property
    def variability(self) -> float:
        """Current fitted variability of the prefill queues."""
        return self._variability

    def prefill(self) -> PrefillModel:
        """The prefill model as fitted so far."""
        return self.prefill_model.scaled(self.correction("prefill")).with_variability(
            self._variability)

    def _ewma(self, old: float, fitted: float) -> float:
        a = self.config.correction_alpha
        return (1 - a) * old + a * fitted

    def _fit_prefill(self, observed_p90: float | None, isl: float, tail_isl: float,
                     per_instance: float, context: float, first_step_s: float) -> None:
        """Light interval (little predicted queueing): fit the service-time scale; loaded
        interval: fit the queue's variability. The model's TTFT holds the interval's own
        handoff (KV transfer of ``context`` tokens, a first decode step of ``first_step_s``),
        so neither fit reads the decode side as a slow prefill."""
        if observed_p90 is None or observed_p90 <= 0 or self.config.correction_alpha <= 0:
            return
        if observed_p90 > self.config.panic_factor * self.config.ttft_slo_s:
            return  # a backlog draining (a burst, a cold start) is no steady-state measurement
        state = self._pools["prefill"]
        model = self.prefill().with_handoff(context, first_step_s)
        wait = model.queue_wait_s(isl, per_instance, 0.9)
        if wait < self.config.queue_share * model.ttft_s(isl, per_instance, 0.9, tail_isl):
            fitted = fit_scale(lambda c: self.prefill_model.scaled(c).with_variability(
                self._variability).with_handoff(context, first_step_s).ttft_s(
                    isl, per_instance, 0.9, tail_isl), observed_p90,
                self.config.correction_bounds)
            state.correction = self._ewma(state.correction, fitted)
        else:
            fitted = fit_scale(lambda v: model.with_variability(v).ttft_s(
                isl, per_instance, 0.9, tail_isl), observed_p90, self.config.variability_bounds)
            self._variability = self._ewma(self._variability, fitted)

    def _fit_decode(self, observed_mean: float | None, per_instance: float) -> None:
        if observed_mean is None or observed_mean <= 0 or self.config.correction_alpha <= 0:
            return
        state = self._pools["decode"]
        fitted = fit_scale(lambda c: self.decode_model.scaled(c).tpot_s(per_instance),
                           observed_mean, self.config.correction_bounds)
        state.correction = self._ewma(state.correction, fitted)

    def plan(self, obs: Observation) -> tuple[Decision, Decision]:
        """Desired (prefill, decode) replicas after this interval."""
        cfg = self.config
        rate = obs.arrivals / obs.interval_s if obs.interval_s > 0 else 0.0
        # The fits compare what the model predicts for the load actually offered.
        isl_now, osl_now = max(obs.mean_isl, 1.0), max(obs.mean_osl, 1.0)
        tail_now = max(obs.p90_isl or isl_now, isl_now)
        ctx_now = max(obs.mean_prompt_tokens or isl_now, isl_now)
        decode_now = self.decode_model.scaled(self.correction("decode"))
        # the first decode step these requests waited for: what decode ran at, as measured
        first_step = obs.tpot_mean_s if obs.tpot_mean_s else decode_now.step_s(
            cfg.target_utilisation * decode_now.max_batch(cfg.tpot_slo_s))
        serving = max(1, obs.prefill_replicas - obs.prefill_starting)
        # A TTFT measured while decode breaks its SLO includes waits for a decode slot: it says
        # nothing about the prefill model, so the prefill fit holds that interval.
        if obs.tpot_p90_s is None or obs.tpot_p90_s <= cfg.tpot_slo_s:
            self._fit_prefill(obs.ttft_p90_s, isl_now, tail_now, rate * isl_now / serving,
                              ctx_now, first_step)
        self._fit_decode(obs.tpot_mean_s, rate * osl_now / max(
            1, obs.decode_replicas - obs.decode_starting))

        prev_base = max(self._rate.predict(1.0), self._level.predict())
        self._rate.observe(rate)
        self._level.observe(rate)
        if obs.mean_isl > 0:  # an interval that served nothing says nothing of lengths
            self._isl.observe(obs.mean_isl)
            self._isl_tail.observe(tail_now / isl_now)
            self._ctx.observe(ctx_now)
        if obs.mean_osl > 0:
            self._osl.observe(obs.mean_osl)
        interval = obs.interval_s if obs.interval_s > 0 else 1.0
        ahead = cfg.forecast_horizon_s / interval
        rate_hat = max(self._rate.predict(1.0), self._rate.predict(max(1.0, ahead)))
        if self._burst is None:
            self._burst = BurstHeadroom(max(2, round(cfg.burst_window_s / interval)),
                                        cfg.max_headroom)
        self._burst.observe(rate, rate_hat)
        # an instance asked for now serves a start time from now, until the next decision
        horizon = math.ceil(ahead) + 1
        factor = self._burst.factor(horizon, cfg.burst_quantile)
        # beyond free_headroom, never plan above a rate this trace has shown (request-weighted)
        ceiling_rate = self._burst.rate_quantile(horizon, cfg.burst_quantile)
        base = max(rate_hat, self._level.predict())
        if self._first_s is None:
            self._first_s = obs.now_s - obs.interval_s
        cold = 1.0 + (cfg.cold_headroom - 1.0) * max(
            0.0, 1.0 - (obs.now_s - self._first_s) / cfg.cold_s) if cfg.cold_s > 0 else 1.0
        cold_base = base
        if cfg.cold_reference_s > 0:
            # the cold headroom is for a step out of the quiet start: it multiplies the level
            # the planner started at until an interval shows that step (then, as without a
            # reference, the stepped level: its backlog sits on the quiet start's instances)
            if not self._start_rates or \
                    obs.now_s - self._first_s <= cfg.cold_reference_s + 1e-9:
                self._start_rates.append(rate)
            if prev_base > 0 and rate >= cfg.cold_burst_factor * prev_base:
                self._stepped = True
            if not self._stepped:
                cold_base = sum(self._start_rates) / len(self._start_rates)
        # An interval with no arrival is planned like any other: the level still remembers the
        # traffic (it decays to nothing within a few intervals once the traffic has stopped).
        # Planning it as zero load let one empty interval scale a pool down and the next one,
        # with a single arrival, scale it straight back up.
        planned_rate = max(rate_hat, base * min(factor, cfg.free_headroom), cold_base * cold,
                           min(base * factor, ceiling_rate))
        headroom = planned_rate / rate_hat if rate_hat > 0 else 1.0
        if obs.prefilled is not None:
            self._backlog = max(0.0, self._backlog + obs.arrivals - obs.prefilled)
        isl_hat, osl_hat = max(self._isl.predict(), 1.0), max(self._osl.predict(), 1.0)
        tail_hat = isl_hat * (max(1.0, self._isl_tail.predict()) if cfg.tail_prompt else 1.0)
        ctx_hat = max(self._ctx.predict(), isl_hat)

        # Prefill: uncached tokens/s against tokens/s per instance within the TTFT SLO, the
        # handoff to decode (KV transfer, first step at the planned batch) inside that SLO.
        backlog_rate = self._backlog / cfg.backlog_drain_s
        load_p = (planned_rate + backlog_rate) * isl_hat
        planned_step = decode_now.step_s(
            cfg.target_utilisation * decode_now.max_batch(cfg.tpot_slo_s))
        model_p = self.prefill().with_handoff(ctx_hat, planned_step)
        # When even an idle instance misses the quantile (the tail prompt alone takes longer
        # than the SLO: cold caches), more instances cannot help it: size for the mean.
        cap_p = model_p.tokens_per_s(isl_hat, cfg.ttft_slo_s, cfg.slo_quantile, tail_hat) \
            or model_p.tokens_per_s(isl_hat, cfg.ttft_slo_s)
        # Decode: output tokens/s against tokens/s per instance within the TPOT SLO.
        # Decode keeps only the forecast: its queue is shared (no request is stuck behind one
        # instance's backlog) and a burst shows as a bigger batch, slower by a step at most
        decode_rate = planned_rate if cfg.decode_headroom else rate_hat
        load_d = (decode_rate + backlog_rate) * osl_hat
        cap_d = decode_now.tokens_per_s(cfg.tpot_slo_s)
        idle = rate <= 0 and rate_hat <= 0
        p = self._decide("prefill", obs.prefill_replicas, load_p, cap_p, obs.ttft_p90_s,
                         cfg.ttft_slo_s, obs.now_s, obs.prefill_starting, idle,
                         obs.prefill_queued)
        d = self._decide("decode", obs.decode_replicas, load_d, cap_d, obs.tpot_p90_s,
                         cfg.tpot_slo_s, obs.now_s, obs.decode_starting, idle,
                         obs.decode_queued)
        return (replace(p, predicted_load=rate_hat * isl_hat, observed_load=rate * isl_now,
                        headroom=headroom),
                replace(d, predicted_load=rate_hat * osl_hat, observed_load=rate * osl_now,
                        headroom=headroom))

    def _decide(self, pool: Pool, current: int, load: float, capacity: float,
                observed_p90: float | None, slo: float, now: float, starting: int,
                idle: bool = False, queued: float | None = None) -> Decision:
        """``capacity``: load one instance takes within the SLO. ``idle``: no arrival in the
        interval and none forecast (with no capacity to size by, only that lets a pool shrink).
        ``queued``: requests waiting in the pool's engines (any holds a scale-down)."""
        cfg, state = self.config, self._pools[pool]
        ceiling = (cfg.max_prefill_replicas if pool == "prefill" else cfg.max_decode_replicas) \
            or cfg.max_replicas
        target, safety = cfg.target_utilisation, cfg.safety_utilisation
        if pool == "decode" and cfg.decode_target_utilisation is not None:
            target = cfg.decode_target_utilisation
            safety = safety * target / cfg.target_utilisation
        if load <= 0 or (capacity <= 0 and idle):
            needed = cfg.min_replicas
        elif capacity <= 0:
            needed = ceiling
        else:
            needed = math.ceil(load / (capacity * target))
        # Scale-down stabilisation (as Kubernetes' HPA does): shrink only to the largest size
        # asked for within the cooldown, so one quiet interval cannot shrink a pool that the
        # interval before needed (and that the next one asks back).
        state.asked = [(t, n) for t, n in state.asked if t > now - cfg.scale_down_cooldown_s]
        state.asked.append((now, needed))
        stable = max(n for _, n in state.asked)
        desired, reason = current, "steady"
        breach = observed_p90 is not None and observed_p90 > cfg.panic_factor * slo
        if breach and needed <= current:
            # one more instance per breached interval, unless one is still starting (it is
            # the remedy already on its way: adding more each interval overshoots)
            needed = current + (starting == 0)
            state.panic_until_s = now + cfg.panic_hold_s
            reason = "panic"
        elif breach:
            state.panic_until_s = now + cfg.panic_hold_s
        if needed > current:
            cap = max(current + 1, math.floor(current * cfg.max_scale_up_factor))
            desired = min(needed, cap)
            reason = "panic" if reason == "panic" else "scale_up"
        elif needed < current:
            if load <= 0 or capacity <= 0:
                remaining_util = 0.0
            elif current > 1:
                remaining_util = load / (capacity * (current - 1))
            else:
                remaining_util = math.inf
            if (starting > 0 or now < state.panic_until_s or stable >= current
                    or now - state.last_change_s < cfg.scale_down_cooldown_s):
                reason = "cooldown"
            elif queued:
                reason = "queued"
            elif remaining_util <= safety:
                desired = max(stable, current - cfg.max_scale_down_step)
                reason = "scale_down"
        bounded = min(ceiling, max(cfg.min_replicas, desired))
        if bounded != desired:
            desired, reason = bounded, "bounds"
        if desired != current:
            state.last_change_s = now
        return Decision(pool, current, desired, reason, load, capacity)
