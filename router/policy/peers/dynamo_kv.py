"""NVIDIA Dynamo's KV router (``--router-mode kv``), as a prefill placement policy.

Follows ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector/default.rs``
(``DefaultWorkerScorer::worker_logit``, ``pick_default_worker``, ``softmax_sample_index``),
``selector/mod.rs`` and ``scheduling/config.rs`` (``KvRouterConfig::default``) @ 07a6c9ce
(research/peer-routers.md §3.2-3.6).

Cost per worker ``w`` (B = block tokens, ISL = prompt tokens), lowest wins::

    raw_w    = (P_w + ISL) / B
    decay_w  = 1 / (1 + delta x ((P_w - min_v P_v) / B) / request_blocks)     (1 when delta = 0)
    adj_w    = max(0, raw_w - c x decay_w x ov_w)
    cost_w   = s x adj_w + D_w + a x active_requests_w

With the defaults this is ``(P_w + ISL - B x ov_w) / B``: the prefill blocks ``w`` still has to
compute, queued ones included; ``D_w`` is 0 unless ``track_active_blocks``.

Parameters (defaults: ``KvRouterConfig::default``):
- ``overlap_score_credit`` (c) = 1.0, ``overlap_score_credit_decay`` (delta) = 0.0,
  ``prefill_load_scale`` (s) = 1.0 (the older ``overlap_score_weight``),
  ``decode_active_request_weight`` (a) = 0.0.
- ``router_temperature`` (T) = 0.0: argmin, exact ties at random. T > 0: sample
  ``p_w ~ exp(-(cost_w - min) / ((max - min) x T))``, uniform when all costs are equal.
- ``track_active_blocks`` = False: Dynamo's config default is true, but its prefill router
  (the P/D placement this registry slot makes) forces it off; set it for an aggregated pool.
  Then ``D_w`` = the distinct KV blocks of the requests live on ``w`` plus this request's blocks
  they do not share (a trailing partial block counts as its own).
- ``seed`` = 0: seeds the tie-break and the temperature draw (:mod:`._common`), standing in for
  Dynamo's reservoir tie-break and ``fastrand``.
- ``block_tokens`` and ``cache_capacity_blocks``: from the context.

Signals: ``P_w`` = ``Candidate.pending_prefill_tokens``: the uncached prompt tokens dispatched to
``w`` and not finished, which is Dynamo's ``active_prefill_tokens`` (uncached prompt tokens of
requests routed to ``w``, released at the first output token) when the caller books them with
this policy's :meth:`cached_prefix_tokens`; ``active_requests_w`` = ``Candidate.in_flight``.
``ov_w`` = leading prompt blocks cached on ``w``.

Cache state: Dynamo's default follows the engines' KV events (``use_kv_events = true``), so its
overlap is exact up to event lag. Here a per-worker LRU of block hashes of the engine's size
(``cache_capacity_blocks``) is filled with each dispatched prompt (Dynamo's ``--no-kv-events``
approximation) and corrected by the engines' events when the router follows them
(``CacheChanged``); without events it stands in for the exact index. Dynamo's approximate mode
expires entries after 120 s idle; a pure policy has no clock, so the LRU bound replaces the TTL.

Not modelled (all off or inapplicable by default): host/disk tier credits (0.75 / 0.25; we have
one tier), ``shared_cache_multiplier`` (0), the router queue (``router_queue_threshold`` None),
conditional disaggregation (off), per-request config overrides, the decode blocks a request
grows while generating. A recently failed worker is skipped while a healthy one exists.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from router.errors import ConfigError
from router.policy.base import (
    CacheChanged,
    Candidate,
    Dispatched,
    Finished,
    PolicyEvent,
    RouteRequest,
    preferred,
)
from router.policy.cache_model import ClusterCacheModel
from router.policy.context import PolicyContext, checked
from router.policy.hashing import request_hashes
from router.policy.peers._common import prompt_tokens, tie_rank, uniform

_PARAMS = ("overlap_score_credit", "overlap_score_credit_decay", "prefill_load_scale",
           "decode_active_request_weight", "router_temperature", "track_active_blocks",
           "seed", "block_tokens", "cache_capacity_blocks")


class DynamoKvPolicy:
    """Lowest (prefill blocks to compute + active blocks); temperature 0 = argmin."""

    name = "dynamo_kv"

    def __init__(self, overlap_score_credit: float = 1.0,
                 overlap_score_credit_decay: float = 0.0, prefill_load_scale: float = 1.0,
                 decode_active_request_weight: float = 0.0, router_temperature: float = 0.0,
                 track_active_blocks: bool = False, seed: int = 0, block_tokens: int = 16,
                 cache_capacity_blocks: int = 20_000) -> None:
        if min(overlap_score_credit, overlap_score_credit_decay, prefill_load_scale,
               decode_active_request_weight, router_temperature) < 0:
            raise ConfigError("Dynamo's weights and router_temperature must be >= 0")
        if block_tokens <= 0 or cache_capacity_blocks <= 0:
            raise ConfigError("block_tokens and cache_capacity_blocks must be > 0")
        self.credit = overlap_score_credit
        self.decay = overlap_score_credit_decay
        self.scale = prefill_load_scale
        self.request_weight = decode_active_request_weight
        self.temperature = router_temperature
        self.track_active_blocks = track_active_blocks
        self.seed = seed
        self.block_tokens = block_tokens
        self.cache = ClusterCacheModel(cache_capacity_blocks, block_tokens)
        self._active: dict[str, Counter[int]] = {}
        """worker -> block hashes of its live requests (with multiplicity)."""
        self._tails: dict[str, int] = {}
        """worker -> live requests' trailing partial blocks (never shared)."""
        self._live: dict[str, tuple[str, tuple[int, ...], int]] = {}
        """request -> (worker, its block hashes, its partial blocks), while tracked."""

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]) -> DynamoKvPolicy:
        """The factory: ``KvRouterConfig::default``; cache geometry from the context."""
        own = checked(cls.name, params, _PARAMS)
        return cls(**{"block_tokens": context.block_tokens,
                      "cache_capacity_blocks": context.cache_capacity_blocks, **own})

    def active_blocks(self, worker_id: str, hashes: Sequence[int], tail: int) -> int:
        """``D_w``: live requests' distinct blocks plus this request's new ones."""
        active = self._active.get(worker_id)
        if active is None:
            return len(hashes) + tail
        new = sum(1 for h in hashes if h not in active)
        return len(active) + self._tails.get(worker_id, 0) + new + tail

    def costs(self, request: RouteRequest, candidates: Sequence[Candidate]) -> dict[str, float]:
        """Every preferred candidate's cost (lower is better)."""
        pool = preferred(candidates)
        if not pool:
            return {}
        b = self.block_tokens
        hashes = request_hashes(request, b)
        isl = prompt_tokens(request, hashes, b)
        request_blocks = -(-isl // b)
        tail = request_blocks - len(hashes)
        p_min = min(c.pending_prefill_tokens for c in pool)
        out = {}
        for c in pool:
            ov = self.cache.match(c.worker_id, hashes)
            decay = 1.0
            if self.decay and request_blocks:
                decay = 1.0 / (1.0 + self.decay * ((c.pending_prefill_tokens - p_min) / b)
                               / request_blocks)
            adj = max(0.0, (c.pending_prefill_tokens + isl) / b - self.credit * decay * ov)
            cost = self.scale * adj + self.request_weight * c.in_flight
            if self.track_active_blocks:
                cost += self.active_blocks(c.worker_id, hashes, tail)
            out[c.worker_id] = cost
        return out

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        costs = self.costs(request, candidates)
        if not costs:
            return None
        seed, rid = self.seed, request.request_id
        lo, hi = min(costs.values()), max(costs.values())
        if self.temperature == 0 or hi == lo:
            tied = [w for w, c in costs.items() if c == lo]
            wid = min(tied, key=lambda w: (tie_rank(seed, rid, w), w))
        else:
            ids = sorted(costs)
            weights = [math.exp(-(costs[w] - lo) / ((hi - lo) * self.temperature)) for w in ids]
            target = uniform(seed, rid, "softmax") * sum(weights)
            wid = ids[-1]
            for w, weight in zip(ids, weights, strict=True):
                target -= weight
                if target < 0:
                    wid = w
                    break
        return next(c for c in candidates if c.worker_id == wid)

    def cached_prefix_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Prompt tokens the overlap index expects ``worker_id`` to reuse."""
        blocks = self.cache.match(worker_id, request_hashes(request, self.block_tokens))
        return min(blocks * self.block_tokens, request.prompt_len)

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched: record the prompt's blocks as cached there (and live, when tracking
        active blocks). Finished: release them. CacheChanged: apply the engine's KV events."""
        if isinstance(event, Dispatched) and event.request is not None:
            hashes = request_hashes(event.request, self.block_tokens)
            self.cache.insert(event.worker_id, hashes)
            if self.track_active_blocks and event.request_id not in self._live:
                isl = prompt_tokens(event.request, hashes, self.block_tokens)
                tail = -(-isl // self.block_tokens) - len(hashes)
                self._active.setdefault(event.worker_id, Counter()).update(hashes)
                self._tails[event.worker_id] = self._tails.get(event.worker_id, 0) + tail
                self._live[event.request_id] = (event.worker_id, tuple(hashes), tail)
        elif isinstance(event, Finished):
            live = self._live.get(event.request_id)
            if live is not None and live[0] == event.worker_id:
                del self._live[event.request_id]
                wid, hashes, tail = live
                active = self._active[wid]
                active.subtract(hashes)
                for h in hashes:
                    if active[h] <= 0:
                        active.pop(h, None)
                self._tails[wid] -= tail
        elif isinstance(event, CacheChanged):
            self.cache.apply(event)
