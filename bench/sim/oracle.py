"""A clairvoyant autoscaler: the reference a causal planner is measured against.

The oracle knows the trace's true relative rate (its shape's knots) and sizes both pools for
the highest level over the next ``lookahead_s`` (a worker's start plus an interval: an
instance asked for now serves only then, and one removed now stops taking work at once). The
pool it picks for a level comes from a steady-state table: for each level of :data:`LEVELS`,
the smallest fixed ``(prefill, decode)`` pool that keeps :data:`TARGET` of the requests within
both SLOs on a constant-rate trace at that level, warm (the first ``warmup_s`` of requests are
not counted, so prefix caches have filled). A level between two table rows takes the pool of
the next higher row.

What it cannot know is everything a causal planner has to guess: when and how far the rate
moves. Its cost over static-peak is therefore what pool-size efficiency alone allows (small
pools multiplex bursty arrivals worse and spread prefixes thinner, so a pool at 0.1 of the
peak rate needs ~0.3 of the peak pool), and its attainment what sizing from steady state
gives through transitions (cold caches on added instances, queues left on the old ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.sim.autoscale import autoscale_summary
from bench.sim.engine import IntervalStats, simulate
from bench.sim.sweep import SweepConfig, make_policy
from bench.sim.workload import SimRequest
from bench.synth import knot_value
from router.autoscale.profile import InstanceProfile

TARGET = 0.95
"""Share of requests within both SLOs a pool must keep (static-peak's and the table's)."""
#: relative rates (of the trace's peak) the steady-state table is measured at
LEVELS: tuple[float, ...] = (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

Knots = Sequence[tuple[float, float]]
PoolTable = dict[float, tuple[int, int]]


def level_at(knots: Knots, t: float) -> float:
    """The relative rate at ``t`` of linearly interpolated ``(time_s, level)`` knots."""
    return knot_value(knots, t)


def smallest_pool(attains: Callable[[int, int], bool], max_prefill: int, max_decode: int
                  ) -> tuple[int, int] | None:
    """The smallest ``(prefill, decode)`` with ``attains``: decode bisected with prefill at
    its maximum, then prefill with that decode (attainment grows with either pool); None when
    even the maximum misses."""
    if not attains(max_prefill, max_decode):
        return None

    def smallest(hi: int, good: Callable[[int], bool]) -> int:
        lo = 0  # invariant: good(hi), not good(lo) (0 instances serve nothing)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if good(mid):
                hi = mid
            else:
                lo = mid
        return hi

    d = smallest(max_decode, lambda d: attains(max_prefill, d))
    return smallest(max_prefill, lambda p: attains(p, d)), d


@dataclass(frozen=True)
class SteadyState:
    """How the steady-state table is measured."""

    policy: str
    ttft_slo_s: float
    tpot_slo_s: float
    profile: InstanceProfile
    max_prefill: int
    max_decode: int
    duration_s: float = 330.0
    warmup_s: float = 110.0

    def attainment(self, reqs: Sequence[SimRequest], prefill: int, decode: int) -> float:
        """Share of the requests after the warm-up within both SLOs on a fixed pool."""
        pp, dp = self.profile.prefill, self.profile.decode
        cfg = SweepConfig(prefill, decode, self.ttft_slo_s, self.tpot_slo_s, pp, dp)
        warm = sum(r.arrival_s < self.warmup_s for r in reqs)
        res = simulate(reqs, make_policy(self.policy, cfg), prefill, decode, pp, dp,
                       rebalance_threshold_s=self.ttft_slo_s, warmup=warm)
        return float(autoscale_summary(res, self.ttft_slo_s, self.tpot_slo_s)["slo_attainment"])

    def pool(self, reqs: Sequence[SimRequest]) -> tuple[int, int]:
        """The smallest pool meeting :data:`TARGET` on ``reqs`` (the maximum if none does)."""
        found = smallest_pool(lambda p, d: self.attainment(reqs, p, d) >= TARGET,
                              self.max_prefill, self.max_decode)
        return found or (self.max_prefill, self.max_decode)


def monotone(entries: dict[float, tuple[int, int]]) -> PoolTable:
    """``level -> pool`` made non-decreasing in the level (a pool that serves a higher rate
    serves a lower one; bisection noise can say otherwise)."""
    table: PoolTable = {}
    best = (1, 1)
    for level in sorted(entries):
        p, d = entries[level]
        best = (max(best[0], p), max(best[1], d))
        table[level] = best
    return table


def pool_for(table: PoolTable, level: float) -> tuple[int, int]:
    """The pool of the lowest table level at or above ``level`` (the top row above all)."""
    for lv in sorted(table):
        if lv >= level - 1e-9:
            return table[lv]
    return table[max(table)]


@dataclass
class OracleController:
    """A :class:`bench.sim.engine.PoolController` that knows the rate: every ``interval_s``
    it asks for the table's pool at the highest level of ``knots`` within ``lookahead_s``
    (times ``margin``; at least ``floor``). ``lookahead_s`` 0: the level now only (the reactive
    reference: what a planner that knew the present exactly, and nothing ahead, would ask)."""

    knots: Knots
    table: PoolTable
    lookahead_s: float = 40.0
    interval_s: float = 10.0
    step_s: float = 1.0
    margin: float = 1.0
    """Size for the level times this (below 1: fewer instances, to trace the frontier)."""
    floor: float = 0.0
    """Size for at least this level, whatever the rate (a pool kept for steps no forecast
    sees coming)."""
    asked: list[tuple[float, tuple[int, int]]] = field(default_factory=list)
    """``(time_s, pools)`` of every decision, for tests and reports."""

    def _want(self, now_s: float) -> tuple[int, int]:
        n = max(0, round(self.lookahead_s / self.step_s))
        level = max(level_at(self.knots, now_s + i * self.step_s) for i in range(n + 1))
        return pool_for(self.table, max(level * self.margin, self.floor))

    def initial(self) -> tuple[int, int]:
        return self._want(0.0)

    def decide(self, stats: IntervalStats) -> tuple[int, int]:
        want = self._want(stats.now_s)
        self.asked.append((stats.now_s, want))
        return want
