"""Preble's E2 runtime selector: exploit a cached prefix when it is longer than what is new,
else explore by load cost; with Preble's node-stealing rebalancer.

Follows WukLab/preble @ 8e7906a3 (2024-05-24), ``preble/global_scheduler_with_time.py``
(``GlobalSchedulerWithTime.runtime_selector``, ``calculate_min_load_cost``,
``handle_important_node_stealing``, ``SlidingWindowHistogram``) and ``preble/global_lru_cache.py``
(``LPRadixCache``) (research/peer-routers.md §5.1).

State, one per model: a radix tree of the prompts (compressed edges; here over chained block
hashes, one entry per block), each node with the GPUs it is *allocated* to and, per GPU, the
live requests through it; a window of the last requests, per "important node" (a node with more
tokens than its context: ``num_tokens > context_so_far``) the requests through it, their hit
and prompt tokens (so a miss rate).

Per request, with the leaf = the node the prompt ends in after inserting it:

- exploit when ``leaf.num_tokens < leaf.context_so_far`` (the new part is shorter than the
  prefix before it): candidates = the GPUs allocated to the leaf, else its nearest allocated
  ancestor, else all; one -> it, several -> the lowest load cost among them;
- explore otherwise: the lowest load cost over all GPUs. (Preble first takes an engine-reported
  "highest hit rate" runtime when one is given; ours give none.)

Load cost, summed over the windowed important nodes ``n`` allocated to GPU ``g``::

    cost(g) = sum_n  missRate(n) x count(n) x T_prefill(n) / |gpus(n)|
                   + refs_g(n) x decode_tokens x tpot_s

with ``T_prefill(n)`` = ``per_token_s`` x the node's tokens (our prefill model; Preble uses a
Mistral-7B fit), ``refs_g(n)`` = requests through ``n`` dispatched to ``g`` and not finished
(for a prefill pool: not yet prefilled). Ties go to the lowest worker id (``np.argmin``).

After each dispatch the chosen GPU is added to the allocation of every node on the prompt's
path, then, once ``rebalance_after`` x #GPUs requests were placed, if the most loaded GPU's cost
(nodes seen at least twice) is >= ``rebalance_factor`` x the least loaded one's, its cheapest
important nodes (seen more than once) move, with their subtrees, to the least loaded GPU until
the gap closes; then the next most loaded against the (updated) least loaded, and so on. Only
when the leaf is within ``rebalance_chain_length`` levels of its important node.

Parameters (defaults: Preble's, ``GlobalSchedulerWithTime``):
- ``window_requests`` = 10,000: the window, in requests. Preble's is 3 minutes of wall time; a
  pure policy has no clock, so it counts dispatches (10,000 = 3 min at ~55 requests/s). When a
  node leaves the window its allocation is reset, as in Preble.
- ``decode_tokens`` = 45: a request's output length (Preble's default ``max_new_tokens``; a
  route request carries none).
- ``tpot_s`` = 0.15: Preble's initial per-GPU TPOT (its median of reported TPOTs; ours get no
  TPOT reports, so it stays).
- ``rebalance`` = True, ``rebalance_factor`` = 1.5 (``HIGH_LOAD_THRESHOLD``),
  ``rebalance_after`` = 50, ``rebalance_chain_length`` = 3.
- ``per_token_s`` and ``block_tokens``: from the context.

Where the code differs from the paper or cannot be followed:
- ``calculate_min_load_cost`` returns ``argmin`` as a position in the candidate list, and the
  exploit branch uses it as a GPU id; with several allocated GPUs that picks GPU 0, 1, ...
  instead of the cheapest. This follows the evident intent (the cheapest allocated GPU).
- Costs are those before this request's own insertion (Preble computes them after splitting the
  tree for it; a split only moves a window entry to the upper half of the split node).
- Not modelled: the single-node replication branch of the rebalancer (it needs Preble's TTFT
  overload detector; our events carry no TTFT), the virtual-eviction recompute cost
  (``enable_eviction``, 198,516 tokens per GPU), the tree's eviction. The tree is never pruned
  (Preble's neither), so its memory grows with distinct prompts.
- A trailing partial block is not in the tree; token counts are whole blocks.
- A recently failed GPU is skipped while a healthy one exists; allocated GPUs that are not
  candidates are dropped from the exploit set (all candidates when none is left).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from router.errors import ConfigError
from router.policy.base import (
    Candidate,
    Dispatched,
    Finished,
    Membership,
    PolicyEvent,
    RouteRequest,
    preferred,
)
from router.policy.cache_model import leading_present
from router.policy.context import PolicyContext, checked
from router.policy.hashing import request_hashes

_PARAMS = ("window_requests", "decode_tokens", "tpot_s", "rebalance", "rebalance_factor",
           "rebalance_after", "rebalance_chain_length", "per_token_s", "block_tokens")


class _Stats:
    """One important node's window counts."""

    __slots__ = ("node", "count", "hit", "prompt")

    def __init__(self, node: _Node) -> None:
        self.node = node
        self.count = 0
        self.hit = 0
        self.prompt = 0


class _Node:
    """A radix-tree node: an edge of blocks, its allocation and live requests per GPU."""

    __slots__ = ("blocks", "parent", "children", "depth", "gpus", "refs", "stats", "contrib",
                 "counted2", "seq")

    def __init__(self, blocks: list[int], parent: _Node | None, depth: int, seq: int) -> None:
        self.blocks = blocks
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.depth = depth
        """Blocks before this node (its context, ``context_so_far``)."""
        self.gpus: dict[str, None] = {}
        self.refs: dict[str, int] = {}
        self.stats: _Stats | None = None
        self.contrib: dict[str, float] = {}
        """What this node adds to each GPU's cost now."""
        self.counted2 = False
        self.seq = seq

    def large(self) -> bool:
        """Preble's ``is_large_node``: more tokens than context."""
        return len(self.blocks) > self.depth


class PrebleState:
    """One model's tree, window and per-GPU costs."""

    def __init__(self, policy: PrebleE2Policy) -> None:
        self.p = policy
        self.seq = 0
        self.root = _Node([], None, 0, 0)
        self.where: dict[int, _Node] = {}
        self.totals: dict[str, float] = {}
        """GPU -> load cost (every windowed node)."""
        self.totals2: dict[str, float] = {}
        """GPU -> load cost of nodes seen at least twice (the rebalancer's view)."""
        self.on_gpu: dict[str, dict[_Node, None]] = {}
        self.window: deque[tuple[_Stats, int, int]] = deque()
        self.placed: dict[str, int] = {}
        self.members: tuple[str, ...] | None = None
        self.live: dict[str, tuple[str, int]] = {}

    # -- reading ----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` in the tree (nodes are never removed: prefix-closed)."""
        return leading_present(hashes, self.where)

    def gpus(self) -> list[str]:
        if self.members is not None:
            return list(self.members)
        return list(self.placed)

    # -- bookkeeping ------------------------------------------------------------------------

    def refresh(self, node: _Node) -> None:
        """Re-account ``node``'s contribution to the per-GPU costs after it changed."""
        totals, totals2, on_gpu = self.totals, self.totals2, self.on_gpu
        for g, v in node.contrib.items():
            totals[g] -= v
            if node.counted2:
                totals2[g] -= v
            held = on_gpu[g]
            del held[node]
            if not held:  # no drift when a GPU holds nothing
                totals[g] = totals2[g] = 0.0
        new: dict[str, float] = {}
        st = node.stats
        if st is not None and node.gpus:
            p = self.p
            miss = 1.0 - st.hit / st.prompt if st.prompt > 0 else 1.0
            prefill = (miss * st.count * p.per_token_s * len(node.blocks) * p.block_tokens
                       / len(node.gpus))
            decode = p.decode_tokens * p.tpot_s
            new = {g: prefill + node.refs.get(g, 0) * decode for g in node.gpus}
        node.contrib = new
        node.counted2 = st is not None and st.count >= 2
        for g, v in new.items():
            totals[g] = totals.get(g, 0.0) + v
            if node.counted2:
                totals2[g] = totals2.get(g, 0.0) + v
            else:
                totals2.setdefault(g, 0.0)
            on_gpu.setdefault(g, {})[node] = None

    def _new_node(self, blocks: list[int], parent: _Node, depth: int) -> _Node:
        self.seq += 1
        node = _Node(blocks, parent, depth, self.seq)
        parent.children[blocks[0]] = node
        for h in blocks:
            self.where[h] = node
        return node

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` blocks; returns the upper part (which inherits
        the allocation and live counts; the window entry moves up when only it stays large)."""
        parent = node.parent
        assert parent is not None
        upper = self._new_node(node.blocks[:k], parent, node.depth)
        upper.gpus = dict(node.gpus)
        upper.refs = dict(node.refs)
        node.blocks = node.blocks[k:]
        node.depth += k
        node.parent = upper
        upper.children = {node.blocks[0]: node}
        if node.stats is not None and upper.large() and not node.large():
            st = node.stats
            node.stats, upper.stats, st.node = None, st, upper
        self.refresh(node)
        self.refresh(upper)
        return upper

    def insert(self, hashes: Sequence[int]) -> _Node:
        """Insert a prompt; returns its leaf (the node it ends in)."""
        n, m = len(hashes), self.match(hashes)
        parent = self.root
        if m:
            parent = self.where[hashes[m - 1]]
            k = m - parent.depth
            if k < len(parent.blocks):
                parent = self._split(parent, k)
        if m == n:
            return parent
        return self._new_node(list(hashes[m:]), parent, m)

    @staticmethod
    def path(node: _Node) -> Iterator[_Node]:
        while node.parent is not None:
            yield node
            node = node.parent

    def dispatched(self, request_id: str, gpu: str, hashes: Sequence[int]) -> None:
        """Preble's bookkeeping after ``runtime_selector`` chose ``gpu``."""
        self.placed[gpu] = self.placed.get(gpu, 0) + 1
        if not hashes:
            return
        leaf = self.insert(hashes)
        important, chain = leaf, 0
        while not important.large():
            assert important.parent is not None
            important, chain = important.parent, chain + 1
        for node in self.path(leaf):
            node.gpus[gpu] = None
            node.refs[gpu] = node.refs.get(gpu, 0) + 1
            self.refresh(node)
        self.live[request_id] = (gpu, hashes[-1])
        st = important.stats
        if st is None:
            st = important.stats = _Stats(important)
        hit, prompt = leaf.depth * self.p.block_tokens, \
            (leaf.depth + len(leaf.blocks)) * self.p.block_tokens
        st.count += 1
        st.hit += hit
        st.prompt += prompt
        self.window.append((st, hit, prompt))
        self.refresh(important)
        while len(self.window) > self.p.window_requests:
            old, hit, prompt = self.window.popleft()
            old.count -= 1
            old.hit -= hit
            old.prompt -= prompt
            node = old.node
            if old.count <= 0:
                node.stats = None
                node.gpus = {}  # Preble resets the allocation of a node that left the window
            self.refresh(node)
        if self.p.rebalance and chain < self.p.rebalance_chain_length:
            self.steal()

    def finished(self, request_id: str, gpu: str) -> None:
        live = self.live.get(request_id)
        if live is None or live[0] != gpu:
            return
        del self.live[request_id]
        for node in self.path(self.where[live[1]]):
            left = node.refs.get(gpu, 0) - 1
            if left > 0:
                node.refs[gpu] = left
            else:
                node.refs.pop(gpu, None)
            if node.contrib:
                self.refresh(node)

    def drop_gpu(self, gpu: str) -> None:
        """``gpu`` left: take it out of the windowed allocations."""
        for node in list(self.on_gpu.get(gpu, {})):
            node.gpus.pop(gpu, None)
            self.refresh(node)
        self.totals.pop(gpu, None)
        self.totals2.pop(gpu, None)
        self.on_gpu.pop(gpu, None)

    def _move(self, node: _Node, gpu: str) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            n.gpus = {gpu: None}
            self.refresh(n)
            stack.extend(n.children.values())

    def steal(self) -> None:
        """``handle_important_node_stealing``: move cheap important nodes from the most to
        the least loaded GPU while the most loaded costs >= factor x the least."""
        gpus = self.gpus()
        factor = self.p.rebalance_factor
        if len(gpus) < 2 or sum(self.placed.values()) < self.p.rebalance_after * len(gpus):
            return
        order = sorted(((g, self.totals2.get(g, 0.0)) for g in gpus), key=lambda x: -x[1])
        while len(order) > 1:
            (big, big_cost), (small, small_cost) = order[0], order[-1]
            if big_cost < factor * small_cost:
                return
            heap = [(n.contrib[big], n.seq, n) for n in self.on_gpu.get(big, {})
                    if n.large() and n.stats is not None and n.stats.count > 1]
            heapq.heapify(heap)
            if len(heap) != 1:  # one node: Preble replicates it if its TTFT overloads (n/a)
                while heap:
                    cost, _, node = heapq.heappop(heap)
                    if big_cost - cost < small_cost + cost:
                        break
                    big_cost -= cost
                    small_cost += cost
                    self._move(node, small)
                    if big_cost < factor * small_cost:
                        break
            order[0], order[-1] = (big, big_cost), (small, small_cost)
            order = order[1:]


class PrebleE2Policy:
    """Exploit the allocated GPUs of a long cached prefix, else the lowest load cost."""

    name = "preble_e2"

    def __init__(self, window_requests: int = 10_000, decode_tokens: int = 45,
                 tpot_s: float = 0.15, rebalance: bool = True, rebalance_factor: float = 1.5,
                 rebalance_after: int = 50, rebalance_chain_length: int = 3,
                 per_token_s: float = 1e-4, block_tokens: int = 16) -> None:
        if window_requests <= 0 or block_tokens <= 0 or per_token_s <= 0:
            raise ConfigError("window_requests, block_tokens and per_token_s must be > 0")
        if decode_tokens < 0 or tpot_s < 0 or rebalance_after < 0:
            raise ConfigError("decode_tokens, tpot_s and rebalance_after must be >= 0")
        if rebalance_factor < 1 or rebalance_chain_length < 1:
            raise ConfigError("rebalance_factor and rebalance_chain_length must be >= 1")
        self.window_requests = window_requests
        self.decode_tokens = decode_tokens
        self.tpot_s = tpot_s
        self.rebalance = rebalance
        self.rebalance_factor = rebalance_factor
        self.rebalance_after = rebalance_after
        self.rebalance_chain_length = rebalance_chain_length
        self.per_token_s = per_token_s
        self.block_tokens = block_tokens
        self._models: dict[str, PrebleState] = {}

    @classmethod
    def from_context(cls, context: PolicyContext, params: Mapping[str, Any]) -> PrebleE2Policy:
        """The factory: Preble's defaults; ``per_token_s`` and ``block_tokens`` from the
        context unless given."""
        own = checked(cls.name, params, _PARAMS)
        return cls(**{"per_token_s": context.per_token_s,
                      "block_tokens": context.block_tokens, **own})

    def state(self, model: str) -> PrebleState | None:
        """The model's tree and costs (None before its first dispatch or membership)."""
        return self._models.get(model)

    def exploit_set(self, state: PrebleState, hashes: Sequence[int]) -> list[str] | None:
        """The allocated GPUs to exploit, or None to explore (as if the prompt were
        inserted)."""
        n, m = len(hashes), state.match(hashes)
        if m == 0:
            return None
        node = state.where[hashes[m - 1]]
        leaf_tokens, leaf_context = (m - node.depth, node.depth) if m == n else (n - m, m)
        if leaf_tokens >= leaf_context:
            return None
        cur: _Node | None = node
        while cur is not None and cur.parent is not None:
            if cur.gpus:
                return list(cur.gpus)
            cur = cur.parent
        return []

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        pool = preferred(candidates)
        if not pool:
            return None
        state = self._models.get(request.model)
        if state is None:
            return min(pool, key=lambda c: c.worker_id)
        hashes = request_hashes(request, self.block_tokens)
        chosen = self.exploit_set(state, hashes) if hashes else None
        if chosen:
            allowed = set(chosen)
            pool = [c for c in pool if c.worker_id in allowed] or pool
        totals = state.totals
        return min(pool, key=lambda c: (totals.get(c.worker_id, 0.0), c.worker_id))

    def _state(self, model: str) -> PrebleState:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = PrebleState(self)
        return state

    def observe(self, event: PolicyEvent) -> None:
        """Dispatched: insert, allocate, count, rebalance. Finished: release the live count.
        Membership: the GPUs the rebalancer balances; departed ones leave the allocations."""
        if isinstance(event, Dispatched):
            model = event.request.model if event.request is not None else event.model
            hashes = () if event.request is None else request_hashes(event.request,
                                                                    self.block_tokens)
            self._state(model).dispatched(event.request_id, event.worker_id, hashes)
        elif isinstance(event, Finished):
            for state in self._models.values():
                if event.request_id in state.live:
                    state.finished(event.request_id, event.worker_id)
                    break
        elif isinstance(event, Membership):
            state = self._state(event.model)
            gone = set(state.gpus()) - set(event.worker_ids)
            state.members = tuple(event.worker_ids)
            for gpu in sorted(gone):
                state.drop_gpu(gpu)
