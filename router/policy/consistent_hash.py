"""Consistent hashing baseline: one ring, the prompt's fixed-depth prefix key.

Parameters (defaults):
- ``vnodes`` = 100: virtual nodes per instance.
- ``block_tokens`` = 16, ``level_tokens`` = 512: the key is the chained hash of the first
  512 tokens (DualMap's depth-1 key, never deepened), so equal prefixes co-locate.

No load term: a hot prefix pins all its traffic on one instance (the reference code's
``cache_affinity`` baseline). Skips cooling-down instances by walking on clockwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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


class ConsistentHashPolicy:
    """The key's owner on a single consistent-hash ring."""

    name = "consistent_hash"

    def __init__(self, vnodes: int = 100, block_tokens: int = 16,
                 level_tokens: int = 512) -> None:
        self.block_tokens = block_tokens
        self._keyer = PrefixKeyer(block_tokens, level_tokens, adaptive=False)
        self._rings = ModelRings(vnodes)

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> ConsistentHashPolicy:
        """The factory: ``vnodes``, ``level_tokens``; ``block_tokens`` from the context."""
        own = checked(cls.name, params, ("vnodes", "block_tokens", "level_tokens"))
        return cls(**{"block_tokens": context.block_tokens, **own})

    def routing_key(self, request: RouteRequest) -> int:
        """The fixed-depth prefix key."""
        hashes = request.block_hashes or block_hashes(request.prompt_token_ids,
                                                      self.block_tokens)
        return self._keyer.key(hashes, request.prompt_len)

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        """The first allowed owner clockwise of the key."""
        index = index_candidates(candidates)
        if not index:
            return None
        allowed = allowed_ids(candidates, index)
        ring = self._rings.ring(request.model, index).ring1
        owner = ring.lookup(self.routing_key(request), allowed)
        return index[owner if owner is not None else min(allowed)]

    def observe(self, event: PolicyEvent) -> None:
        """Membership: update the ring."""
        if isinstance(event, Membership):
            self._rings.set_members(event.model, event.worker_ids)
