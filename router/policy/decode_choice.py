"""Decode placement: least loaded by running sequences and KV usage, within capacity limits.

Parameters (defaults):
- ``max_running`` = 256: a worker with this many running sequences is full (vLLM's
  ``max_num_seqs`` default).
- ``max_kv_usage`` = 0.95: a worker whose KV cache is this full is full.

Load score = ``running / max_running + kv_usage`` (both in [0, 1]); lowest wins, ties by fewer
in-flight requests, then worker id. ``running`` is the larger of the worker's reported
``vllm:num_requests_running`` (``Candidate.running``) and the router's in-flight count. When
every worker is full the least-loaded full one is returned (the engine queues it) unless
``strict`` is set, then None ("no candidate": the caller waits or sheds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.errors import ConfigError
from router.policy.base import Candidate, LoadOrdered, PolicyEvent, RouteRequest, preferred
from router.policy.context import PolicyContext, checked


class DecodeChoicePolicy:
    """Least-loaded decode choice with capacity limits."""

    name = "kv_aware"

    def __init__(self, max_running: int = 256, max_kv_usage: float = 0.95,
                 strict: bool = False) -> None:
        if max_running <= 0 or not 0 < max_kv_usage <= 1:
            raise ConfigError("need max_running > 0 and 0 < max_kv_usage <= 1")
        self.max_running = max_running
        self.max_kv_usage = max_kv_usage
        self.strict = strict

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> DecodeChoicePolicy:
        """The factory: ``max_running``, ``max_kv_usage``, ``strict`` (the context has none)."""
        return cls(**checked(cls.name, params, ("max_running", "max_kv_usage", "strict")))

    def score(self, c: Candidate) -> float:
        """Load in [0, 2]; lower is better."""
        return max(c.running, c.in_flight) / self.max_running + c.kv_usage

    def has_room(self, c: Candidate) -> bool:
        """Below both capacity limits."""
        return max(c.running, c.in_flight) < self.max_running and c.kv_usage < self.max_kv_usage

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        """The least-loaded candidate with room."""
        if isinstance(candidates, LoadOrdered):
            # kept in load order by the caller: the least loaded has room or nobody has
            least = candidates.least_loaded()
            if least is None or self.has_room(least):
                return least
            return None if self.strict else least
        pool = preferred(candidates)
        if not pool:
            return None
        roomy = [c for c in pool if self.has_room(c)]
        if not roomy:
            if self.strict:
                return None
            roomy = pool
        return min(roomy, key=lambda c: (self.score(c), c.in_flight, c.worker_id))

    def observe(self, event: PolicyEvent) -> None:
        """Stateless."""
