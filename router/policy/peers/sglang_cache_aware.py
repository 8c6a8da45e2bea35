"""SGLang's ``cache_aware`` placement (sgl-router / sgl-model-gateway; vllm-router's copy).

Follows ``CacheAwarePolicy::select_worker`` in ``sgl-model-gateway/src/policies/cache_aware.rs``
(sgl-project/sglang @ b93974f1; the same rule as lightseekorg/smg @ a57f4802, the sglang-era
state), with the tree of ``crates/kv_index/src/string_tree.rs`` (research/peer-routers.md
§1.2-1.5).

Parameters (defaults: the deployed router's CLI, ``router_args.py`` and ``main.rs``):
- ``cache_threshold`` = 0.3: take the tree's worker when matched / prompt > this.
- ``balance_abs_threshold`` = 64 and ``balance_rel_threshold`` = 1.5: the load is imbalanced
  when ``max - min > 64`` and ``max > 1.5 x min`` (requests in flight).
- ``max_tree_tokens`` = 16,777,216: each worker's share of the tree, SGLang's ``max_tree_size``
  = 2^26 characters at 4 characters per token.
- ``tie_break`` = ``"index"``: min-load ties go to the lowest worker id (sglang's
  ``min_by_key``, first index; our ids stand for its worker order); ``"processed"`` orders them
  by requests dispatched so far first (SMG #1714, 2026-06).
- ``block_tokens`` = the context's (16): the tree's granularity.

Where the code and its shipped defaults differ: ``CacheAwareConfig::default()`` (threshold 0.5,
abs 32, rel 1.1, eviction every 30 s to 10,000) is the library/test default; the CLI values above
are what a deployed router runs, so they are used here.

Algorithm, per request (``L_w`` = ``Candidate.in_flight``, the router's in-flight count, over the
healthy candidates; a recently failed worker is skipped while a healthy one exists, as SGLang
routes only to healthy workers):

1. imbalanced = ``L_max - L_min > abs`` and ``L_max > rel x L_min`` -> the least-loaded worker;
2. else ``(m, node)`` = the deepest node of the tree the prompt reaches; rate = matched tokens /
   prompt tokens; if ``rate > cache_threshold`` and the node's tenant is a candidate -> that
   tenant;
3. else the least-loaded worker (the min-load miss branch of PR #14650, 2025-12; before it the
   miss went to the worker with the smallest tree). A tenant that is no candidate (gone, cooling
   down, already tried) also falls through to the least loaded, as the research note's
   pseudo-code has it; the sglang-era code took the first healthy worker there instead.

The approximate tree: our own small structure over chained block hashes, one per model, not
:class:`~router.policy.cache_model.PrefixCacheModel` (SGLang's tree is shared by all workers and
remembers who *created* each node). A node is one block; it keeps its tenants in insertion order
and its creator. The tenant returned is the creator of the deepest matched node (SGLang's
``last_tenant``: the worker that first routed that prefix, copied on split, never updated), else
its first remaining tenant (SGLang: first in DashMap order). ``observe(Dispatched)`` inserts the
prompt for the chosen worker whichever branch chose it (SGLang inserts in ``select_worker``).

Eviction: per tenant, an LRU of its blocks; an insert touches the prompt last-to-first, so a
tenant's leaves are its least recent blocks, and a tenant over ``max_tree_tokens`` loses its LRU
leaves until it fits (SGLang: ``evict_tenant_by_size`` pops each tenant's LRU leaves down to
``max_tree_size`` characters). SGLang does this in a background sweep every 120 s; a pure policy
has no clock, so it is done at each insert (the tree never overshoots between sweeps). A node with
no tenant left is removed. ``observe(Membership)`` removes departed workers' entries (sglang-era;
SMG leaves them to age out).

Other deviations, each small: the match counts whole blocks (SGLang counts characters, including
a partial match into the next edge); SMG's 1-in-8 timestamp refresh on match is not modelled
(``select`` is pure); SGLang's ``load()`` lives until the response stream ends, ours is the pool's
in-flight count (for a prefill pool: until the prefill finishes). Engine KV events are ignored
(SGLang's HTTP mode has none).
"""

from __future__ import annotations

from collections import OrderedDict
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
from router.policy.cache_model import leading_present
from router.policy.context import PolicyContext, checked
from router.policy.hashing import request_hashes
from router.policy.peers._common import prompt_tokens

TIE_BREAKS = ("index", "processed")


class _Node:
    """One block of the tree: who created it and who holds it (insertion order)."""

    __slots__ = ("creator", "tenants")

    def __init__(self, creator: str) -> None:
        self.creator = creator
        self.tenants: dict[str, None] = {creator: None}


class ApproximateTree:
    """One model's router-side tree: block hash -> node, and each tenant's blocks in LRU order.

    A tenant's blocks are prefix-closed (an insert touches a prompt last-to-first, so a block is
    never less recent than the blocks after it and eviction pops leaves), hence so is the union,
    and both matches are binary searches.
    """

    def __init__(self, budget_blocks: int) -> None:
        self.budget_blocks = budget_blocks
        self.nodes: dict[int, _Node] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, hashes: Sequence[int]) -> int:
        """Blocks of ``hashes`` on the tree's deepest matched path (any tenant)."""
        return leading_present(hashes, self.nodes)

    def held(self, tenant: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that ``tenant`` holds."""
        lru = self._lru.get(tenant)
        return 0 if lru is None else leading_present(hashes, lru)

    def tenant(self, block_hash: int) -> str:
        """The node's tenant: its creator while it still holds it, else its first tenant."""
        node = self.nodes[block_hash]
        return node.creator if node.creator in node.tenants else next(iter(node.tenants))

    def insert(self, tenant: str, hashes: Sequence[int]) -> None:
        """``tenant`` was sent ``hashes``: attach it along the path, then evict to its budget."""
        nodes = self.nodes
        lru = self._lru.setdefault(tenant, OrderedDict())
        for h in reversed(hashes):
            node = nodes.get(h)
            if node is None:
                nodes[h] = _Node(tenant)
            else:
                node.tenants[tenant] = None
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.budget_blocks:
            self._detach(tenant, lru.popitem(last=False)[0])

    def _detach(self, tenant: str, block_hash: int) -> None:
        node = self.nodes[block_hash]
        del node.tenants[tenant]
        if not node.tenants:
            del self.nodes[block_hash]

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything ``tenant`` holds (it left)."""
        lru = self._lru.pop(tenant, None)
        for h in lru or ():
            self._detach(tenant, h)

    def tenants(self) -> list[str]:
        return list(self._lru)


class SGLangCacheAwarePolicy:
    """Balance check, then the approximate tree's worker, else the least loaded."""

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 1 << 24,
                 tie_break: str = "index", block_tokens: int = 16) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ConfigError("balance_abs_threshold must be >= 0 and balance_rel_threshold "
                              ">= 1")
        if tie_break not in TIE_BREAKS:
            raise ConfigError(f"tie_break must be one of {', '.join(TIE_BREAKS)}, "
                              f"got {tie_break!r}")
        if block_tokens <= 0 or max_tree_tokens < block_tokens:
            raise ConfigError("block_tokens must be > 0 and max_tree_tokens >= block_tokens")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tie_break = tie_break
        self.block_tokens = block_tokens
        self._budget_blocks = max_tree_tokens // block_tokens
        self._trees: dict[str, ApproximateTree] = {}
        self._processed: dict[str, int] = {}

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]
                     ) -> SGLangCacheAwarePolicy:
        """The factory: the CLI defaults; ``block_tokens`` from the context unless given."""
        own = checked(cls.name, params, ("cache_threshold", "balance_abs_threshold",
                                         "balance_rel_threshold", "max_tree_tokens",
                                         "tie_break", "block_tokens"))
        return cls(**{"block_tokens": context.block_tokens, **own})

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """SGLang's balance check over the healthy workers' loads."""
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _least_loaded(self, pool: Sequence[Candidate]) -> Candidate:
        if self.tie_break == "processed":
            done = self._processed
            return min(pool, key=lambda c: (c.in_flight, done.get(c.worker_id, 0), c.worker_id))
        return min(pool, key=lambda c: (c.in_flight, c.worker_id))

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        pool = preferred(candidates)
        if not pool:
            return None
        if self.imbalanced([c.in_flight for c in pool]):
            return self._least_loaded(pool)
        tree = self._trees.get(request.model)
        hashes = request_hashes(request, self.block_tokens)
        matched = tree.match(hashes) if tree is not None else 0
        total = prompt_tokens(request, hashes, self.block_tokens)
        if tree is not None and matched and total:
            rate = min(matched * self.block_tokens, total) / total
            if rate > self.cache_threshold:
                tenant = tree.tenant(hashes[matched - 1])
                for cand in pool:
                    if cand.worker_id == tenant:
                        return cand
        return self._least_loaded(pool)

    def cached_prefix_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Prompt tokens the tree says ``worker_id`` was sent before."""
        tree = self._trees.get(request.model)
        if tree is None:
            return 0
        hashes = request_hashes(request, self.block_tokens)
        return min(tree.held(worker_id, hashes) * self.block_tokens, request.prompt_len)

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched: insert the prompt for the worker, count it. Membership: drop departed
        workers from the tree."""
        if isinstance(event, Dispatched):
            self._processed[event.worker_id] = self._processed.get(event.worker_id, 0) + 1
            if event.request is not None:
                model = event.request.model or event.model
                tree = self._trees.get(model)
                if tree is None:
                    tree = self._trees[model] = ApproximateTree(self._budget_blocks)
                tree.insert(event.worker_id, request_hashes(event.request, self.block_tokens))
        elif isinstance(event, Membership):
            live = set(event.worker_ids)
            tree = self._trees.get(event.model)
            if tree is not None:
                for tenant in tree.tenants():
                    if tenant not in live:
                        tree.remove_tenant(tenant)
