"""llm-d's default scheduling profile (the EPP's built-in config), with its optional
"stick or spill" prefix-affinity filter.

Follows llm-d/llm-d-router @ ebab6879 (2026-08-22; ex llm-d-inference-scheduler, ex GIE EPP):
``pkg/epp/config/loader/defaults.go`` (``loadDefaultConfig``),
``pkg/epp/scheduling/{scheduler_profile.go,weighted_scorer.go}``, the scorers and picker under
``pkg/epp/framework/plugins/scheduling/``, ``requestcontrol/dataproducer/{approximateprefix,
prefixhash,inflightload}`` and ``filter/prefixcacheaffinity`` (research/peer-routers.md
§2.2-2.5, §2.7).

Score, per endpoint ``e`` of the (filtered) candidates, max-score picker::

    S(e) = 2 Q(e) + 2 K(e) + 3 P(e) [+ w_tok T(e)]
    Q(e) = (q_max - q_e) / (q_max - q_min), 1 when all equal     (queue-scorer)
    K(e) = 1 - kv_usage_e                                        (kv-cache-utilization-scorer)
    P(e) = matchedBlocks_e / totalBlocks, 0 without blocks       (prefix-cache-scorer, approx.)
    T(e) = 1 - min(1, inFlightTokens_e / 4,194,304)              (token-load-scorer; weight 0)

Parameters (defaults: the default profile; the filter's from the Aug-2026 code):
- ``queue_weight`` = 2, ``kv_cache_weight`` = 2, ``prefix_weight`` = 3, ``token_load_weight``
  = 0 (not in the default profile), ``token_load_threshold`` = 4,194,304 tokens.
- ``prefix_block_tokens`` = 64: llm-d hashes token chunks of the engine block size clamped to
  >= 64 tokens; rounded up to a whole number of our blocks.
- ``max_prefix_tokens`` = 131,072: tokens hashed at most.
- ``lru_capacity_per_server`` = 31,250: blocks remembered per endpoint (llm-d's fallback; with
  autotune it is the engine's ``CacheNumBlocks``).
- ``affinity_filter`` = False: the default profile has no filter (the Helm chart turns it on
  only with the latency predictor). When on: ``affinity_threshold`` = 0.80,
  ``max_ttft_penalty_ms`` = 18,000, ``peak_prefill_tokens_per_s`` = 15,928 (ttftSource
  ``prefillThroughput``), ``exploration_probability`` = 0 (May-2026 code: 5,000 ms and 0.01).
  The llm-d "Stick or Spill" recipe for prefill-bound traffic is this filter with the
  token-load scorer alone: ``affinity_filter=True, token_load_weight=1, queue_weight=0,
  kv_cache_weight=0, prefix_weight=0``.
- ``seed`` = 0: seeds the picker's tie-break and the filter's exploration draw.
- ``block_tokens`` = the context's (16).

Stick or spill (``prefix-cache-affinity-filter``): with more than one endpoint and no
exploration draw, sticky = ``{e : P(e) >= threshold}``; if sticky is empty or everyone, keep all;
``TTFT(e) = inFlightTokens_e / peak x 1000`` ms; if ``min_sticky TTFT - min_rest TTFT >
max_ttft_penalty_ms`` keep all (spill), else keep the sticky ones.

Signals: ``q_e`` is vLLM's ``num_requests_waiting``; a candidate carries no waiting count, so it
is ``max(in_flight - running, 0)``: the requests this router sent and the engine does not run
(``in_flight`` when the engine's running count is unknown, as in the simulator).
``inFlightTokens`` is ``Candidate.pending_prefill_tokens`` (the uncached prompt tokens in flight,
as llm-d's ``inflight-load-producer`` counts them, discounted by this policy's
:meth:`cached_prefix_tokens`). llm-d reads the queue and KV terms from a 50 ms scrape, so they lag
and ignore its own recent picks; here they are as fresh as the caller's snapshot.

Cache state (approximate mode, llm-d's default): a per-endpoint LRU of chained block hashes
(:class:`~router.policy.cache_model.ClusterCacheModel`) filled with the chosen endpoint's blocks
at dispatch (``PreRequest``); nothing from the engine (engine KV events belong to llm-d's precise
mode and are ignored). llm-d walks the hashes and gives +1 to every endpoint holding each one,
stopping at the first hash nobody holds; since each endpoint's LRU keeps its cached part of a
chain a prefix, that count is each endpoint's longest cached prefix, which is what is used.
llm-d also hashes a trailing partial chunk; we hash full blocks only (so ``totalBlocks`` counts
full blocks, and a repeated prompt still scores 1).

Picker: llm-d shuffles, stable-sorts by score and takes the first, so ties go uniformly at
random; here to the lowest seeded per-request rank (:func:`._common.tie_rank`). llm-d merged a
deterministic tie-break after the snapshot (#2515); its rule is not modelled.

A recently failed endpoint is skipped while a healthy one exists (llm-d only offers ready pods).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.errors import ConfigError
from router.policy.base import (
    Candidate,
    Dispatched,
    Membership,
    PolicyEvent,
    RouteRequest,
    preferred,
)
from router.policy.cache_model import ClusterCacheModel
from router.policy.context import PolicyContext, checked
from router.policy.hashing import request_hashes
from router.policy.peers._common import blocks_per, coarsen, tie_rank, uniform

_PARAMS = ("queue_weight", "kv_cache_weight", "prefix_weight", "token_load_weight",
           "token_load_threshold", "prefix_block_tokens", "max_prefix_tokens",
           "lru_capacity_per_server", "affinity_filter", "affinity_threshold",
           "max_ttft_penalty_ms", "peak_prefill_tokens_per_s", "exploration_probability",
           "seed", "block_tokens")


def _clamp01(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else x


class LlmdDefaultPolicy:
    """llm-d's default scorer ensemble, max-score picker, optional stick-or-spill filter."""

    name = "llmd_default"

    def __init__(self, queue_weight: float = 2.0, kv_cache_weight: float = 2.0,
                 prefix_weight: float = 3.0, token_load_weight: float = 0.0,
                 token_load_threshold: int = 4_194_304, prefix_block_tokens: int = 64,
                 max_prefix_tokens: int = 131_072, lru_capacity_per_server: int = 31_250,
                 affinity_filter: bool = False, affinity_threshold: float = 0.80,
                 max_ttft_penalty_ms: float = 18_000.0,
                 peak_prefill_tokens_per_s: float = 15_928.0,
                 exploration_probability: float = 0.0, seed: int = 0,
                 block_tokens: int = 16) -> None:
        if min(queue_weight, kv_cache_weight, prefix_weight, token_load_weight) < 0:
            raise ConfigError("scorer weights must be >= 0")
        if (token_load_threshold <= 0 or prefix_block_tokens <= 0 or max_prefix_tokens <= 0
                or lru_capacity_per_server <= 0 or block_tokens <= 0
                or peak_prefill_tokens_per_s <= 0):
            raise ConfigError("token_load_threshold, prefix_block_tokens, max_prefix_tokens, "
                              "lru_capacity_per_server, peak_prefill_tokens_per_s and "
                              "block_tokens must be > 0")
        if not 0 <= affinity_threshold <= 1 or not 0 <= exploration_probability <= 1:
            raise ConfigError("affinity_threshold and exploration_probability must be in [0, 1]")
        self.weights = (queue_weight, kv_cache_weight, prefix_weight, token_load_weight)
        self.token_load_threshold = token_load_threshold
        self.affinity_filter = affinity_filter
        self.affinity_threshold = affinity_threshold
        self.max_ttft_penalty_ms = max_ttft_penalty_ms
        self.peak_prefill_tokens_per_s = peak_prefill_tokens_per_s
        self.exploration_probability = exploration_probability
        self.seed = seed
        self.block_tokens = block_tokens
        self.factor = blocks_per(prefix_block_tokens, block_tokens)
        self.max_blocks = max(1, max_prefix_tokens // (self.factor * block_tokens))
        self._capacity = lru_capacity_per_server
        self._caches: dict[str, ClusterCacheModel] = {}

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> LlmdDefaultPolicy:
        """The factory: the default profile; ``block_tokens`` from the context unless given."""
        own = checked(cls.name, params, _PARAMS)
        return cls(**{"block_tokens": context.block_tokens, **own})

    def prefix_hashes(self, request: RouteRequest) -> Sequence[int]:
        """The request's hashes at llm-d's block size, capped at ``max_prefix_tokens``."""
        return coarsen(request_hashes(request, self.block_tokens), self.factor)[:self.max_blocks]

    def prefix_scores(self, request: RouteRequest, pool: Sequence[Candidate]
                      ) -> dict[str, float]:
        """``P(e)``: the fraction of the request's blocks cached on each endpoint."""
        hashes = self.prefix_hashes(request)
        cache = self._caches.get(request.model)
        if not hashes or cache is None:
            return {c.worker_id: 0.0 for c in pool}
        n = len(hashes)
        return {c.worker_id: cache.match(c.worker_id, hashes) / n for c in pool}

    def ttft_ms(self, cand: Candidate) -> float:
        """The affinity filter's TTFT estimate (ttftSource ``prefillThroughput``)."""
        return cand.pending_prefill_tokens / self.peak_prefill_tokens_per_s * 1000.0

    def stick_or_spill(self, request: RouteRequest, pool: list[Candidate],
                       prefix: Mapping[str, float]) -> list[Candidate]:
        """The ``prefix-cache-affinity-filter``: the cache-hot endpoints unless they are
        slower than the best cold one by more than the penalty."""
        if len(pool) <= 1 or (self.exploration_probability > 0 and uniform(
                self.seed, request.request_id, "explore") < self.exploration_probability):
            return pool
        sticky = [c for c in pool if prefix[c.worker_id] >= self.affinity_threshold]
        rest = [c for c in pool if prefix[c.worker_id] < self.affinity_threshold]
        if not sticky or not rest:
            return pool
        gap = min(map(self.ttft_ms, sticky)) - min(map(self.ttft_ms, rest))
        if self.max_ttft_penalty_ms > 0 and gap > self.max_ttft_penalty_ms:
            return pool
        return sticky

    def scores(self, request: RouteRequest, candidates: Sequence[Candidate]
               ) -> dict[str, float]:
        """``S(e)`` of every endpoint that passes the filter."""
        pool = preferred(candidates)
        if not pool:
            return {}
        prefix = self.prefix_scores(request, pool)
        if self.affinity_filter:
            pool = self.stick_or_spill(request, pool, prefix)
        wq, wk, wp, wt = self.weights
        queue = {c.worker_id: max(c.in_flight - c.running, 0) for c in pool}
        q_lo, q_hi = min(queue.values()), max(queue.values())
        out = {}
        for c in pool:
            wid = c.worker_id
            q = 1.0 if q_hi == q_lo else (q_hi - queue[wid]) / (q_hi - q_lo)
            k = 1.0 - _clamp01(c.kv_usage)
            t = 1.0 - min(1.0, c.pending_prefill_tokens / self.token_load_threshold)
            out[wid] = wq * q + wk * k + wp * _clamp01(prefix[wid]) + wt * t
        return out

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        scores = self.scores(request, candidates)
        if not scores:
            return None
        best = max(scores.values())
        seed, rid = self.seed, request.request_id
        wid = min((w for w, s in scores.items() if s == best),
                  key=lambda w: (tie_rank(seed, rid, w), w))
        return next(c for c in candidates if c.worker_id == wid)

    def cached_prefix_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Prompt tokens the approximate index expects ``worker_id`` to reuse."""
        cache = self._caches.get(request.model)
        if cache is None:
            return 0
        blocks = cache.match(worker_id, self.prefix_hashes(request))
        return min(blocks * self.factor * self.block_tokens, request.prompt_len)

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched: add the request's blocks to the endpoint's LRU (``PreRequest``).
        Membership: forget departed endpoints (llm-d purges them every 2 min)."""
        if isinstance(event, Dispatched) and event.request is not None:
            model = event.request.model or event.model
            cache = self._caches.get(model)
            if cache is None:
                cache = self._caches[model] = ClusterCacheModel(
                    self._capacity, self.factor * self.block_tokens)
            cache.insert(event.worker_id, self.prefix_hashes(event.request))
        elif isinstance(event, Membership):
            cache = self._caches.get(event.model)
            if cache is not None:
                cache.retain(event.worker_ids)
