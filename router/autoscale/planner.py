"""SLO-driven planner: observations in, desired replica counts per pool out (pure).

Each interval the planner forecasts the arrival rate and the mean uncached input and output
lengths, turns them into load (prefill: uncached tokens/s; decode: output tokens/s), and
divides by what one instance sustains within its SLO (``capacity.py``).
The load is the larger of the next interval's forecast and the forecast ``forecast_horizon_s``
ahead (a worker's start time: an instance asked for now serves only then). The models are
fitted online: each interval the planner compares the latency it observed with what its model
predicts for the load each serving instance got. Prefill: a light interval (the model puts
under ``queue_share`` of the p90 TTFT in queueing) fits the service-time scale (the
``correction``; 1.0 = the profile is right), a loaded one fits the queue's variability
(burstiness of arrivals and prompt lengths, which no single-request profile measures).
Decode: the mean TPOT fits the step-time scale. Each fit is an EWMA. Then:

- scale up at once (at most ``max_scale_up_factor`` x current per interval);
- scale down one instance at a time, only after ``scale_down_cooldown_s`` since the pool last
  changed, never while one of its instances is still starting, and only if the remaining
  instances stay below ``safety_utilisation``;
- panic: when the observed p90 latency breaks its SLO by ``panic_factor`` while the model says
  the pool is big enough, add one instance per interval (none while one is still starting)
  and hold scale-down for ``panic_hold_s``.

Parameters (defaults) are the fields of :class:`PlannerConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from router.autoscale.capacity import DecodeModel, PrefillModel, fit_scale
from router.autoscale.predictors import Predictor, make_predictor

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
    scale_down_cooldown_s: float = 60.0
    max_scale_up_factor: float = 2.0
    panic_factor: float = 1.5
    panic_hold_s: float = 60.0
    predictor: str = "holt"
    forecast_horizon_s: float = 30.0
    """Also plan for the load forecast this far ahead (about a worker's start time)."""
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


@dataclass(frozen=True)
class Decision:
    """Desired replicas of one pool and why."""

    pool: Pool
    current: int
    desired: int
    reason: str
    """One of: steady, scale_up, scale_down, cooldown, panic, bounds."""
    load: float
    capacity_per_instance: float

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current \
            else "none"


@dataclass
class _PoolState:
    last_change_s: float = -math.inf
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

    def __post_init__(self) -> None:
        self._rate = make_predictor(self.config.predictor)
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
                     per_instance: float) -> None:
        """Light interval (little predicted queueing): fit the service-time scale; loaded
        interval: fit the queue's variability."""
        if observed_p90 is None or observed_p90 <= 0 or self.config.correction_alpha <= 0:
            return
        if observed_p90 > self.config.panic_factor * self.config.ttft_slo_s:
            return  # a backlog draining (a burst, a cold start) is no steady-state measurement
        state, model = self._pools["prefill"], self.prefill()
        wait = model.queue_wait_s(isl, per_instance, 0.9)
        if wait < self.config.queue_share * model.ttft_s(isl, per_instance, 0.9, tail_isl):
            fitted = fit_scale(lambda c: self.prefill_model.scaled(c).with_variability(
                self._variability).ttft_s(isl, per_instance, 0.9, tail_isl), observed_p90,
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
        rate = obs.arrivals / obs.interval_s if obs.interval_s > 0 else 0.0
        # The fits compare what the model predicts for the load actually offered.
        isl_now, osl_now = max(obs.mean_isl, 1.0), max(obs.mean_osl, 1.0)
        tail_now = max(obs.p90_isl or isl_now, isl_now)
        serving = max(1, obs.prefill_replicas - obs.prefill_starting)
        # A TTFT measured while decode breaks its SLO includes waits for a decode slot: it says
        # nothing about the prefill model, so the prefill fit holds that interval.
        if obs.tpot_p90_s is None or obs.tpot_p90_s <= self.config.tpot_slo_s:
            self._fit_prefill(obs.ttft_p90_s, isl_now, tail_now, rate * isl_now / serving)
        self._fit_decode(obs.tpot_mean_s, rate * osl_now / max(
            1, obs.decode_replicas - obs.decode_starting))

        self._rate.observe(rate)
        if obs.mean_isl > 0:  # an interval that served nothing says nothing of lengths
            self._isl.observe(obs.mean_isl)
            self._isl_tail.observe(tail_now / isl_now)
        if obs.mean_osl > 0:
            self._osl.observe(obs.mean_osl)
        cfg = self.config
        ahead = cfg.forecast_horizon_s / obs.interval_s if obs.interval_s > 0 else 1.0
        rate_hat = max(self._rate.predict(1.0), self._rate.predict(max(1.0, ahead)))
        isl_hat, osl_hat = max(self._isl.predict(), 1.0), max(self._osl.predict(), 1.0)
        tail_hat = isl_hat * max(1.0, self._isl_tail.predict())

        # Prefill: uncached tokens/s against tokens/s per instance within the TTFT SLO.
        load_p = rate_hat * isl_hat
        cap_p = self.prefill().tokens_per_s(isl_hat, cfg.ttft_slo_s, cfg.slo_quantile, tail_hat)
        # Decode: output tokens/s against tokens/s per instance within the TPOT SLO.
        load_d = rate_hat * osl_hat
        cap_d = self.decode_model.scaled(self.correction("decode")).tokens_per_s(cfg.tpot_slo_s)
        return (self._decide("prefill", obs.prefill_replicas, load_p, cap_p, obs.ttft_p90_s,
                             cfg.ttft_slo_s, obs.now_s, obs.prefill_starting),
                self._decide("decode", obs.decode_replicas, load_d, cap_d,
                             obs.tpot_p90_s, cfg.tpot_slo_s, obs.now_s, obs.decode_starting))

    def _decide(self, pool: Pool, current: int, load: float, capacity: float,
                observed_p90: float | None, slo: float, now: float, starting: int) -> Decision:
        """``capacity``: load one instance takes within the SLO."""
        cfg, state = self.config, self._pools[pool]
        ceiling = (cfg.max_prefill_replicas if pool == "prefill" else cfg.max_decode_replicas) \
            or cfg.max_replicas
        if load <= 0:
            needed = cfg.min_replicas
        elif capacity <= 0:
            needed = ceiling
        else:
            needed = math.ceil(load / (capacity * cfg.target_utilisation))
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
            if load <= 0:
                remaining_util = 0.0
            elif current > 1 and capacity > 0:
                remaining_util = load / (capacity * (current - 1))
            else:
                remaining_util = math.inf
            if (starting > 0 or now < state.panic_until_s
                    or now - state.last_change_s < cfg.scale_down_cooldown_s):
                reason = "cooldown"
            elif remaining_util <= cfg.safety_utilisation:
                desired, reason = current - 1, "scale_down"
        bounded = min(ceiling, max(cfg.min_replicas, desired))
        if bounded != desired:
            desired, reason = bounded, "bounds"
        if desired != current:
            state.last_change_s = now
        return Decision(pool, current, desired, reason, load, capacity)
