"""Admission control: take a request only while the pool it needs can still serve it in time.

Pure (no I/O, no clock): the router hands the pool's :class:`Candidate` snapshots and gets a
verdict. A pool is refused when

- every worker already runs ``max_in_flight_per_worker`` requests (0 = no bound), or
- even its least-loaded prefill worker's queue (uncached prompt tokens it holds, at
  ``per_token_s`` each) exceeds ``queue_slo_factor`` x ``ttft_slo_s`` (0 = off): a request
  admitted now would miss its TTFT SLO anyway, and would push every later one past it too.

A refusal carries ``retry_after_s``: the predicted time for the queue to drain below the bar
(at least 1 s), which the router sends as ``Retry-After`` with a 429.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.policy.base import Candidate


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds of one pool (defaults: everything admitted)."""

    max_in_flight_per_worker: int = 0
    queue_slo_factor: float = 0.0
    ttft_slo_s: float = 5.0
    per_token_s: float = 1e-4

    def __post_init__(self) -> None:
        if self.max_in_flight_per_worker < 0 or self.queue_slo_factor < 0:
            raise ValueError("admission limits must be >= 0")
        if self.ttft_slo_s <= 0 or self.per_token_s <= 0:
            raise ValueError("ttft_slo_s and per_token_s must be > 0")


@dataclass(frozen=True)
class Verdict:
    """Whether to admit; when not, why and when to come back."""

    admit: bool
    reason: str = ""
    retry_after_s: int = 0


ADMIT = Verdict(True)


def admit(candidates: Sequence[Candidate], limits: AdmissionLimits, *,
          prefill: bool) -> Verdict:
    """The verdict for a pool (``prefill``: the queue bound applies too). An empty pool is
    admitted: the router's own no-worker handling answers it."""
    if not candidates:
        return ADMIT
    bound = limits.max_in_flight_per_worker
    if bound and all(max(c.in_flight, c.running) >= bound for c in candidates):
        return Verdict(False, f"every worker runs {bound} requests", 1)
    if prefill and limits.queue_slo_factor:
        wait_s = min(c.pending_prefill_tokens for c in candidates) * limits.per_token_s
        bar_s = limits.queue_slo_factor * limits.ttft_slo_s
        if wait_s > bar_s:
            return Verdict(False, f"prefill queue {wait_s:.1f} s > {bar_s:.1f} s",
                           max(1, math.ceil(wait_s - bar_s)))
    return ADMIT
