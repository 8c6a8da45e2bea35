"""The simulator's per-interval meter: what a metrics scrape would see every control interval.

It counts arrivals and tokens, collects TTFT/TPOT of the requests that got their first token,
and integrates over time the serving instances and the running sequences, so a
:class:`~bench.sim.engine.PoolController` gets busy fractions and slot usage per interval.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IntervalStats:
    """What one control interval saw: the simulator's equivalent of a metrics scrape."""

    now_s: float
    interval_s: float
    arrivals: int
    uncached_tokens: int
    """Prompt tokens prefilled (prefix-cache hits excluded) in the interval."""
    output_tokens: int
    """Output tokens of the requests that started decoding in the interval."""
    ttft_s: tuple[float, ...]
    """TTFT of each request whose first token came in the interval."""
    tpot_s: tuple[float, ...]
    """TPOT of the same requests (those with more than one output token)."""
    prefill_replicas: int
    """Prefill instances serving or starting (what the last decision asked for)."""
    decode_replicas: int
    prefill_ready: int
    decode_ready: int
    prefill_busy: float
    """Busy fraction of the serving prefill instances (0..1, time-weighted)."""
    decode_slots: float
    """Running sequences / ``max_running`` over the serving decode instances (0..1)."""
    uncached_per_request: tuple[int, ...] = ()
    """Uncached prompt tokens of each request prefilled in the interval."""
    prompt_tokens: int = 0
    """Whole prompt tokens (cached ones too) of the requests prefilled in the interval."""


class IntervalMeter:
    """Counters since the last tick plus the time integrals (``advance`` before any change
    to the serving counts or the running sequences)."""

    def __init__(self, serving_prefill: int, serving_decode: int) -> None:
        self.serving_p = serving_prefill
        self.serving_d = serving_decode
        self.running = 0
        """Running decode sequences over every instance."""
        self.last_tick = 0.0
        self._area_t = 0.0
        self._reset()

    def _reset(self) -> None:
        self.arrivals = self.uncached = self.output = self.prompt = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.unc: list[int] = []
        self.p_busy = 0.0
        self._p_area = self._d_area = self._run_area = 0.0

    def advance(self, now: float) -> None:
        """Accumulate the time integrals up to ``now``."""
        dt = now - self._area_t
        if dt > 0:
            self._p_area += self.serving_p * dt
            self._d_area += self.serving_d * dt
            self._run_area += self.running * dt
            self._area_t = now

    def snapshot(self, now: float, counts: tuple[int, int, int, int, int, int],
                 max_running: int) -> IntervalStats:
        """The interval ending at ``now`` (``counts`` as ``ReplicaPoint``'s fields); resets
        the counters."""
        pr, pt, _, dr, dt, _ = counts
        stats = IntervalStats(
            now, now - self.last_tick, self.arrivals, self.uncached, self.output,
            tuple(self.ttft), tuple(self.tpot), pt, dt, pr, dr,
            min(1.0, self.p_busy / self._p_area) if self._p_area > 0 else 0.0,
            min(1.0, self._run_area / (self._d_area * max_running)) if self._d_area > 0 else 0.0,
            tuple(self.unc), self.prompt)
        self.last_tick = now
        self._reset()
        return stats
