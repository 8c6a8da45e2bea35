"""SLO-driven planner: observations in, desired replica counts per pool out (pure).

Each interval the planner forecasts the arrival rate and the mean uncached input and output
lengths, turns them into load (prefill: uncached tokens/s; decode: concurrent sequences by
Little's law), and divides by what one instance sustains within its SLO (``capacity.py``),
corrected online by observed/predicted latency. Then:

- scale up at once (at most ``max_scale_up_factor`` x current per interval);
- scale down one instance at a time, only after ``scale_down_cooldown_s`` since the pool last
  changed, and only if the remaining instances stay below ``safety_utilisation``;
- panic: when the observed p90 latency breaks its SLO by ``panic_factor`` while the model says
  the pool is big enough, add instances anyway and hold scale-down for ``panic_hold_s``.

Parameters (defaults) are the fields of :class:`PlannerConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from router.autoscale.capacity import DecodeModel, PrefillModel
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
    target_utilisation: float = 0.8
    """Plan for this fraction of an instance's SLO capacity (headroom for bursts)."""
    safety_utilisation: float = 0.6
    """Scale down only if the remaining instances would run below this fraction of capacity."""
    scale_down_cooldown_s: float = 60.0
    max_scale_up_factor: float = 2.0
    panic_factor: float = 1.5
    panic_hold_s: float = 60.0
    predictor: str = "holt"
    correction_alpha: float = 0.3  # 0 disables the online correction
    """EWMA weight of each new observed/predicted latency ratio."""
    correction_bounds: tuple[float, float] = (0.25, 4.0)

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
    """Mean uncached prompt tokens per request (prefix-cache hits already subtracted)."""
    mean_osl: float
    prefill_replicas: int
    decode_replicas: int
    ttft_p90_s: float | None = None
    ttft_mean_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_mean_s: float | None = None


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
    _osl: Predictor = field(init=False)
    _pools: dict[str, _PoolState] = field(init=False)

    def __post_init__(self) -> None:
        self._rate = make_predictor(self.config.predictor)
        self._isl = make_predictor("ewma")
        self._osl = make_predictor("ewma")
        self._pools = {"prefill": _PoolState(), "decode": _PoolState()}

    def correction(self, pool: Pool) -> float:
        """Current observed/predicted latency ratio of ``pool`` (1.0 = model is right)."""
        return self._pools[pool].correction

    def _update_correction(self, pool: Pool, observed: float | None, predicted: float) -> None:
        if observed is None or observed <= 0 or predicted <= 0:
            return
        state, (lo, hi), a = self._pools[pool], self.config.correction_bounds, \
            self.config.correction_alpha
        state.correction = min(hi, max(lo, (1 - a) * state.correction + a * observed / predicted))

    def plan(self, obs: Observation) -> tuple[Decision, Decision]:
        """Desired (prefill, decode) replicas after this interval."""
        rate = obs.arrivals / obs.interval_s if obs.interval_s > 0 else 0.0
        # Corrections compare what the model predicted for the load actually offered.
        isl_now, osl_now = max(obs.mean_isl, 1.0), max(obs.mean_osl, 1.0)
        per_prefill = rate * isl_now / max(1, obs.prefill_replicas)
        self._update_correction("prefill", obs.ttft_mean_s,
                                self.prefill_model.mean_ttft_s(isl_now, per_prefill))
        seqs = rate * osl_now * (obs.tpot_mean_s or self.decode_model.step_s(1))
        self._update_correction("decode", obs.tpot_mean_s, self.decode_model.step_s(
            seqs / max(1, obs.decode_replicas)))

        self._rate.observe(rate)
        self._isl.observe(obs.mean_isl)
        self._osl.observe(obs.mean_osl)
        rate_hat = self._rate.predict()
        isl_hat, osl_hat = max(self._isl.predict(), 1.0), max(self._osl.predict(), 1.0)

        cfg = self.config
        # Prefill: uncached tokens/s against tokens/s per instance within the TTFT SLO.
        cap_p = (self.prefill_model.tokens_per_s(isl_hat, cfg.ttft_slo_s)
                 / self.correction("prefill"))
        load_p = rate_hat * isl_hat
        # Decode: concurrent sequences by Little's law (rate x tokens x observed time per token;
        # the model's single-sequence step time until a TPOT was observed).
        cap_d = self.decode_model.max_batch(cfg.tpot_slo_s / self.correction("decode"))
        load_d = rate_hat * osl_hat * (obs.tpot_mean_s or self.decode_model.step_s(1))
        return (self._decide("prefill", obs.prefill_replicas, load_p, cap_p, obs.ttft_p90_s,
                             cfg.ttft_slo_s, obs.now_s),
                self._decide("decode", obs.decode_replicas, load_d, float(cap_d),
                             obs.tpot_p90_s, cfg.tpot_slo_s, obs.now_s))

    def _decide(self, pool: Pool, current: int, load: float, capacity: float,
                observed_p90: float | None, slo: float, now: float) -> Decision:
        cfg, state = self.config, self._pools[pool]
        usable = capacity * cfg.target_utilisation
        if load <= 0:
            needed = cfg.min_replicas
        else:
            needed = math.ceil(load / usable) if usable > 0 else cfg.max_replicas
        desired, reason = current, "steady"
        breach = observed_p90 is not None and observed_p90 > cfg.panic_factor * slo
        if breach and needed <= current:
            needed = current + 1
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
            if now < state.panic_until_s or now - state.last_change_s < cfg.scale_down_cooldown_s:
                reason = "cooldown"
            elif remaining_util <= cfg.safety_utilisation:
                desired, reason = current - 1, "scale_down"
        ceiling = (cfg.max_prefill_replicas if pool == "prefill" else cfg.max_decode_replicas) \
            or cfg.max_replicas
        bounded = min(ceiling, max(cfg.min_replicas, desired))
        if bounded != desired:
            desired, reason = bounded, "bounds"
        if desired != current:
            state.last_change_s = now
        return Decision(pool, current, desired, reason, load, capacity)
