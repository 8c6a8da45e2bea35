"""AIBrix's ``prefix-cache`` routing strategy (the gateway plugin's prefix-match router).

Follows vllm-project/aibrix @ e3e10f9e (2026-08-22),
``pkg/plugins/gateway/algorithms/prefix_cache.go`` (``routeOriginal``,
``getTargetPodListOnLoadImbalance``, ``getTargetPodFromMatchedPods``), ``least_request.go``,
``util.go`` and ``pkg/utils/prefixcacheindexer/hash.go`` (research/peer-routers.md §4.2).

Algorithm, per request (``r_i`` = ``Candidate.in_flight``, the gateway-tracked running requests;
ready pods = candidates not recently failed, or all when every one failed):

1. ``cand`` = ready pods; if ``max r - min r > imbalance_abs_count``: ``cand`` = the pods at
   ``min r`` (the imbalance gate);
2. walk the request's block hashes; a pod of ``cand`` stays matched while each block's entry
   lists it, and the walk stops when no pod is left; ``pct_i = floor(100 (k_i) / nBlocks)`` for
   the ``k_i >= 1`` leading blocks pod ``i`` holds;
3. order the matched pods by ``pct`` descending, then ``r`` ascending (AIBrix shuffles before its
   stable sort; here remaining ties follow a seeded per-request rank), and take the first with
   ``r_i <= mean(r) + std_dev_factor x std(r)``, mean and (sample, n - 1) standard deviation
   over all ready pods;
4. otherwise least-request over all ready pods (ties at random: the seeded rank).

``observe(Dispatched)`` adds every block hash of the prompt to the pod (``AddPrefix``).

Parameters (defaults: the shipped manifests, ``gateway-plugin.yaml`` and the release overlay):
- ``imbalance_abs_count`` = 16 (``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT``;
  code default 8).
- ``std_dev_factor`` = 2 (``..._STANDARD_DEVIATION_FACTOR``; code default 1).
- ``prefix_block_tokens`` = 32: ``AIBRIX_PREFIX_CACHE_BLOCK_SIZE`` = 128 bytes (code default 4)
  of the ``character`` tokenizer, i.e. 128 characters, at 4 characters per token; rounded up to a
  whole number of our blocks. Only full blocks are hashed, as in AIBrix.
- ``block_number`` = 200,000: entries of the global LRU (``..._BLOCK_NUMBER``).
- ``seed`` = 0: seeds the tie-break.
- ``block_tokens`` = the context's (16).

Cache state: one global LRU of block entries (not one per pod), each holding ``model -> {pods}``;
adding a prefix touches its blocks first-to-last (so a prompt's first block is the least recent
and goes first), and a pod leaves an entry only when the whole entry is evicted, so the state
over-approximates what pods cache. AIBrix also drops entries idle for 20 min (swept every 1 s);
a pure policy has no clock, so only the LRU bound is modelled. A lookup does not touch the LRU
(``LRUStore.Get`` does not either). Engine KV events (AIBrix's optional KV-event sync, off by
default) are ignored.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from router.errors import ConfigError
from router.policy.base import Candidate, Dispatched, PolicyEvent, RouteRequest, preferred
from router.policy.context import PolicyContext, checked
from router.policy.hashing import request_hashes
from router.policy.peers._common import blocks_per, coarsen, tie_rank

_PARAMS = ("imbalance_abs_count", "std_dev_factor", "prefix_block_tokens", "block_number",
           "seed", "block_tokens")


def sample_std(values: Sequence[float]) -> float:
    """AIBrix's ``standardDeviation``: sample (n - 1) deviation, 0 for one value or none."""
    n = len(values)
    if n <= 1:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


class AibrixPrefixPolicy:
    """Best prefix match % among pods within mean + F x std load, else least-request."""

    name = "aibrix_prefix"

    def __init__(self, imbalance_abs_count: int = 16, std_dev_factor: float = 2.0,
                 prefix_block_tokens: int = 32, block_number: int = 200_000, seed: int = 0,
                 block_tokens: int = 16) -> None:
        if imbalance_abs_count < 0 or std_dev_factor < 0:
            raise ConfigError("imbalance_abs_count and std_dev_factor must be >= 0")
        if prefix_block_tokens <= 0 or block_number <= 0 or block_tokens <= 0:
            raise ConfigError("prefix_block_tokens, block_number and block_tokens must be > 0")
        self.imbalance_abs_count = imbalance_abs_count
        self.std_dev_factor = std_dev_factor
        self.block_number = block_number
        self.seed = seed
        self.block_tokens = block_tokens
        self.factor = blocks_per(prefix_block_tokens, block_tokens)
        self._store: OrderedDict[int, dict[str, dict[str, None]]] = OrderedDict()
        """block hash -> model -> pods; least recently added first."""

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> AibrixPrefixPolicy:
        """The factory: the shipped manifests' values; ``block_tokens`` from the context."""
        own = checked(cls.name, params, _PARAMS)
        return cls(**{"block_tokens": context.block_tokens, **own})

    def prefix_hashes(self, request: RouteRequest) -> Sequence[int]:
        """The request's hashes at AIBrix's block size."""
        return coarsen(request_hashes(request, self.block_tokens), self.factor)

    def leading_blocks(self, model: str, hashes: Sequence[int], pods: Sequence[str]
                       ) -> dict[str, int]:
        """``pod -> k``: the leading blocks whose entries list it, for the pods of ``pods``
        holding at least the first block; the walk stops when no pod is left
        (``seqSearchPrefix``)."""
        left = set(pods)
        out: dict[str, int] = {}
        for i, h in enumerate(hashes):
            entry = self._store.get(h)
            holders = entry.get(model) if entry is not None else None
            if not holders:
                break
            left = {p for p in left if p in holders}
            if not left:
                break
            for p in left:
                out[p] = i + 1
        return out

    def match(self, model: str, hashes: Sequence[int], pods: Sequence[str]) -> dict[str, int]:
        """``pod -> pct`` = ``floor(100 k / nBlocks)`` (AIBrix's ``prefixMatchPercent``)."""
        n = len(hashes)
        return {p: k * 100 // n for p, k in self.leading_blocks(model, hashes, pods).items()}

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        ready = preferred(candidates)
        if not ready:
            return None
        seed, rid = self.seed, request.request_id
        load = {c.worker_id: c.in_flight for c in ready}
        lo, hi = min(load.values()), max(load.values())
        cand = [w for w in load if load[w] == lo] if hi - lo > self.imbalance_abs_count \
            else list(load)
        matched = self.match(request.model, self.prefix_hashes(request), cand)
        if matched:
            counts = [float(v) for v in load.values()]
            bound = sum(counts) / len(counts) + self.std_dev_factor * sample_std(counts)
            for wid in sorted(matched, key=lambda w: (-matched[w], load[w],
                                                      tie_rank(seed, rid, w), w)):
                if load[wid] <= bound:
                    return next(c for c in ready if c.worker_id == wid)
        wid = min((w for w in load if load[w] == lo), key=lambda w: (tie_rank(seed, rid, w), w))
        return next(c for c in ready if c.worker_id == wid)

    def cached_prefix_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Prompt tokens of the leading blocks whose entries list ``worker_id``."""
        hashes = self.prefix_hashes(request)
        blocks = self.leading_blocks(request.model, hashes, (worker_id,)).get(worker_id, 0)
        return min(blocks * self.factor * self.block_tokens, request.prompt_len)

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched: ``AddPrefix`` every block hash of the prompt to the pod."""
        if not isinstance(event, Dispatched) or event.request is None:
            return
        model = event.request.model or event.model
        store = self._store
        for h in self.prefix_hashes(event.request):
            entry = store.get(h)
            if entry is None:
                store[h] = {model: {event.worker_id: None}}
            else:
                entry.setdefault(model, {})[event.worker_id] = None
                store.move_to_end(h)
        while len(store) > self.block_number:
            store.popitem(last=False)
