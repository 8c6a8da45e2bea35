"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018).

Parameters (defaults):
- ``epsilon`` = 0.25: load slack. With ``m`` requests in flight (counting this one) over ``n``
  instances, an instance may hold at most ``ceil((1 + epsilon) x m / n)``.
- ``vnodes`` = 100, ``block_tokens`` = 16, ``level_tokens`` = 512: as
  :mod:`router.policy.consistent_hash` (same ring, same fixed-depth key).

The pick is the first instance clockwise of the key whose in-flight count is below the bound, so
a hot prefix overflows onto its ring successors instead of piling up. Load is counted in requests
(``Candidate.in_flight``), as in the paper and HAProxy's ``hash-balance-factor``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from router.errors import ConfigError
from router.policy._rings import ModelRings, allowed_ids
from router.policy.base import (
    Candidate,
    Membership,
    PolicyEvent,
    RouteRequest,
    index_candidates,
)
from router.policy.context import PolicyContext, checked
from router.policy.hashing import block_hashes
from router.policy.hot_prefix import PrefixKeyer


class BoundedLoadHashPolicy:
    """Consistent hashing whose owners refuse work above ``(1 + epsilon)`` x the mean load."""

    name = "bounded_load_hash"

    def __init__(self, epsilon: float = 0.25, vnodes: int = 100, block_tokens: int = 16,
                 level_tokens: int = 512) -> None:
        if epsilon <= 0:
            raise ConfigError(f"epsilon must be > 0, got {epsilon}")
        self.epsilon = epsilon
        self.block_tokens = block_tokens
        self._keyer = PrefixKeyer(block_tokens, level_tokens, adaptive=False)
        self._rings = ModelRings(vnodes)

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> BoundedLoadHashPolicy:
        """The factory: ``epsilon``, ``vnodes``, ``level_tokens``; ``block_tokens`` from the
        context."""
        own = checked(cls.name, params, ("epsilon", "vnodes", "block_tokens", "level_tokens"))
        return cls(**{"block_tokens": context.block_tokens, **own})

    def bound(self, total_in_flight: int, n: int) -> int:
        """Most requests one instance may hold once this request is placed."""
        return math.ceil((1 + self.epsilon) * (total_in_flight + 1) / n)

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        """The first instance clockwise of the key that is under the load bound."""
        index = index_candidates(candidates)
        if not index:
            return None
        allowed = allowed_ids(candidates, index)
        cap = self.bound(sum(c.in_flight for c in allowed.values()), len(allowed))
        hashes = request.block_hashes or block_hashes(request.prompt_token_ids,
                                                      self.block_tokens)
        key = self._keyer.key(hashes, request.prompt_len)
        ring = self._rings.ring(request.model, index).ring1
        for wid in ring.walk(key):
            cand = allowed.get(wid)
            if cand is not None and cand.in_flight < cap:
                return cand
        # unreachable while cap > mean load; kept so a stale ring still answers
        return min(allowed.values(), key=lambda c: (c.in_flight, c.worker_id))

    def observe(self, event: PolicyEvent) -> None:
        """Membership: update the ring."""
        if isinstance(event, Membership):
            self._rings.set_members(event.model, event.worker_ids)
