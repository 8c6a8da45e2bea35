"""Least-loaded placement (the default decode choice).

Parameters: none.

Picks the candidate with the fewest outstanding prompt tokens
(``Candidate.pending_prefill_tokens``, router-side accounting; 0 for decode workers), then the
fewest in-flight requests (``Candidate.in_flight``). Ties are broken round-robin by
``worker_id`` after the last dispatched worker, so an idle pool still spreads sequential
requests instead of piling them on the first worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policy.base import Candidate, PolicyEvent, RouteRequest, preferred
from router.policy.round_robin import RoundRobinPolicy


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self) -> None:
        self._ties = RoundRobinPolicy()

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        pool = preferred(candidates)
        if not pool:
            return None
        low = min((c.pending_prefill_tokens, c.in_flight) for c in pool)
        return self._ties.select(
            request, [c for c in pool if (c.pending_prefill_tokens, c.in_flight) == low])

    def observe(self, event: PolicyEvent) -> None:
        self._ties.observe(event)
