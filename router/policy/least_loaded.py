"""Least-loaded placement (the default decode choice).

Parameters: none.

Picks the candidate with the fewest outstanding prompt tokens
(``Candidate.pending_prefill_tokens``; 0 for decode workers), then the fewest requests held
(the larger of the router's ``Candidate.in_flight`` and the worker's reported
``Candidate.running``, which also counts requests other routers sent). Ties are broken
round-robin by ``worker_id`` after the last dispatched worker, so an idle pool still spreads
sequential requests instead of piling them on the first worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.policy.base import Candidate, PolicyEvent, RouteRequest, preferred
from router.policy.context import PolicyContext, checked
from router.policy.round_robin import RoundRobinPolicy


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self) -> None:
        self._ties = RoundRobinPolicy()

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> LeastLoadedPolicy:
        """The factory: no parameters."""
        checked(cls.name, params, ())
        return cls()

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        pool = preferred(candidates)
        if not pool:
            return None
        def load(c: Candidate) -> tuple[int, int]:
            return c.pending_prefill_tokens, max(c.in_flight, c.running)

        low = min(load(c) for c in pool)
        return self._ties.select(request, [c for c in pool if load(c) == low])

    def observe(self, event: PolicyEvent) -> None:
        self._ties.observe(event)
