"""Prefix-only baseline: the instance with the longest cached prefix wins.

Parameters (defaults):
- ``block_tokens`` = 16: tokens per hashed block.
- ``cache_capacity_blocks`` = 20,000: router-side LRU per instance (:mod:`cache_model`).

Every candidate's cache model is matched against the prompt; ties (including "nobody has it")
go to fewer pending uncached tokens, then fewer in-flight requests, then the lower worker id.
No load term beyond ties, so a hot prefix stays where it was first cached.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.policy._rings import allowed_ids
from router.policy.base import (
    CacheChanged,
    Candidate,
    Dispatched,
    PolicyEvent,
    RouteRequest,
    index_candidates,
)
from router.policy.cache_model import ClusterCacheModel
from router.policy.context import PolicyContext, checked
from router.policy.hashing import request_hashes


class PrefixOnlyPolicy:
    """Longest cached prefix first."""

    name = "prefix_only"

    def __init__(self, block_tokens: int = 16, cache_capacity_blocks: int = 20_000) -> None:
        self.block_tokens = block_tokens
        self.cache = ClusterCacheModel(cache_capacity_blocks, block_tokens)

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> PrefixOnlyPolicy:
        """The factory: ``block_tokens`` and ``cache_capacity_blocks`` from the context unless
        given."""
        own = checked(cls.name, params, ("block_tokens", "cache_capacity_blocks"))
        return cls(**{"block_tokens": context.block_tokens,
                      "cache_capacity_blocks": context.cache_capacity_blocks, **own})

    def hashes(self, request: RouteRequest) -> Sequence[int]:
        """The request's block hashes (given, or computed from its token ids)."""
        return request_hashes(request, self.block_tokens)

    def cached_prefix_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Tokens of the prompt the cache model expects ``worker_id`` to reuse."""
        blocks = self.cache.match(worker_id, self.hashes(request))
        return min(blocks * self.block_tokens, request.prompt_len)

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        """The candidate with the most cached blocks (ties: least loaded, then id)."""
        index = index_candidates(candidates)
        if not index:
            return None
        allowed = allowed_ids(candidates, index)
        hashes = self.hashes(request)
        match = self.cache.match
        return min(allowed.values(), key=lambda c: (
            -match(c.worker_id, hashes), c.pending_prefill_tokens, c.in_flight, c.worker_id))

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched: record the prompt's blocks on the chosen instance. CacheChanged: apply
        the engine's KV events."""
        if isinstance(event, Dispatched) and event.request is not None:
            self.cache.insert(event.worker_id, self.hashes(event.request))
        elif isinstance(event, CacheChanged):
            self.cache.apply(event)
