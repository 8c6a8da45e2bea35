"""Round-robin placement.

Parameters: none.

Candidates are ordered by ``worker_id``; the pick is the first worker whose id sorts after the
last one dispatched for the same model, wrapping around. Keying on the id (not an index) keeps the
rotation fair when workers join or leave, and two routers fed the same events pick alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.policy.base import Candidate, Dispatched, PolicyEvent, RouteRequest, preferred
from router.policy.context import PolicyContext, checked


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._last: dict[str, str] = {}  # model -> id of the last dispatched worker

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> RoundRobinPolicy:
        """The factory: no parameters."""
        checked(cls.name, params, ())
        return cls()

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        pool = sorted(preferred(candidates), key=lambda c: c.worker_id)
        if not pool:
            return None
        last = self._last.get(request.model)
        if last is not None:
            for cand in pool:
                if cand.worker_id > last:
                    return cand
        return pool[0]

    def observe(self, event: PolicyEvent) -> None:
        if isinstance(event, Dispatched):
            self._last[event.model] = event.worker_id
