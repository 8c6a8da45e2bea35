"""Selective disaggregation: when a request skips the prefill hop.

Disaggregation pays for long uncached prompts (their prefill would stall a decode batch) and
costs a hop, a transfer and a second engine for the rest. llm-d's decider disaggregates only
when the chosen decode worker does not already hold the prefix; this one also keeps short
prompts on the decode worker. The rule, for the decode worker the decode policy chose:

    uncached = prompt tokens - tokens of the prompt's prefix that worker caches (estimated)
    path     = "decode_only" if uncached < min_prefill_tokens else "pd"

Parameters (defaults): ``min_prefill_tokens`` = 0 (always disaggregate; classic P/D),
``capacity_blocks`` = 20,000 per decode worker in the cache estimate, ``block_tokens`` = 16 (must
match the router's hashing). The estimate records every prompt a decode worker was given
(pulled or computed, its KV ends up in that worker's prefix cache) and forgets in LRU order.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.policy.base import Dispatched, Membership, PolicyEvent, RouteRequest
from router.policy.cache_model import DEFAULT_CAPACITY_BLOCKS, PrefixCacheModel
from router.policy.hashing import DEFAULT_BLOCK_TOKENS


@dataclass(frozen=True)
class PathChoice:
    """``pd`` or ``decode_only``, with the reason (a bounded metric label)."""

    path: str
    reason: str
    cached_tokens: int


class SelectiveDisaggregation:
    """Decides P/D vs decode-only per request from its uncached length on the decode worker."""

    def __init__(self, min_prefill_tokens: int = 0,
                 capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {min_prefill_tokens}")
        self.min_prefill_tokens = min_prefill_tokens
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._caches: dict[str, PrefixCacheModel] = {}

    @property
    def enabled(self) -> bool:
        """False when every request is disaggregated (threshold 0)."""
        return self.min_prefill_tokens > 0

    def cached_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Estimated prompt tokens ``worker_id`` holds in its prefix cache."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0
        return min(cache.match(request.block_hashes) * self.block_tokens, request.prompt_len)

    def decide(self, request: RouteRequest, decode_worker_id: str) -> PathChoice:
        """The path of ``request`` if it goes to ``decode_worker_id``."""
        cached = self.cached_tokens(request, decode_worker_id)
        uncached = request.prompt_len - cached
        if not self.enabled or uncached >= self.min_prefill_tokens:
            return PathChoice("pd", "long_uncached_prompt" if self.enabled else "always",
                              cached)
        reason = "short_prompt" if request.prompt_len < self.min_prefill_tokens \
            else "cached_on_decode"
        return PathChoice("decode_only", reason, cached)

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched to a decode worker: its cache now holds the prompt; Membership: forget
        workers that left."""
        if isinstance(event, Dispatched) and event.request is not None:
            cache = self._caches.get(event.worker_id)
            if cache is None:
                cache = self._caches[event.worker_id] = PrefixCacheModel(self.capacity_blocks)
            cache.insert(event.request.block_hashes)
        elif isinstance(event, Membership):
            for worker_id in set(self._caches) - set(event.worker_ids):
                del self._caches[worker_id]
