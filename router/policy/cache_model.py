"""Router-side model of each instance's prefix cache: a bounded LRU of block hashes.

Parameters (defaults):
- ``capacity_blocks`` = 20,000: blocks remembered per instance (20,000 x 16 tokens = 320k tokens,
  about the KV room of an 8B model on one 80 GB GPU). The GIE prefix scorer's default is 31,250.
- ``block_tokens`` = 16: tokens per block; must match the hashing.

The model is an estimate: the router records what it sent where. ``insert`` touches the blocks
last-to-first so a prompt's first blocks are the most recently used and the tail is evicted first
(as vLLM does), which keeps "cached" a prefix. With ``--kv-events`` the engines also tell what
they stored and evicted (``CacheChanged`` events, :meth:`ClusterCacheModel.apply`).

``match`` is a binary search while the cached part of every chain is a prefix (only LRU
evictions). An engine's eviction may remove a block from the middle of a chain the router
recorded (e.g. a dispatched prompt's trailing partial engine block, never cached by the engine,
stays after its full blocks are evicted), so once a model has seen a ``remove`` its ``match``
scans from the front and stops at the first miss (robust; it costs one lookup per cached block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from router.policy.base import CacheChanged
from router.policy.hashing import DEFAULT_BLOCK_TOKENS

DEFAULT_CAPACITY_BLOCKS = 20_000



def leading_present(hashes: Sequence[int], present: Container[int]) -> int:
    """How many leading ``hashes`` are in ``present``, by binary search: right when what
    ``present`` holds of a chain is always a prefix of it (chained hashes, evicted from the
    end)."""
    lo, hi = 0, len(hashes)  # hashes[:lo] present; hashes[hi] (if any) known absent
    if hi and hashes[0] not in present:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in present:
            lo = mid
        else:
            hi = mid - 1
    return lo

class PrefixCacheModel:
    """One instance's LRU set of block hashes."""

    __slots__ = ("capacity_blocks", "_lru", "_holes")

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._holes = False

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` present (the reusable cached prefix).

        A binary search: chained hashes make block ``i``'s hash name the whole prefix ``0..i``,
        and ``insert`` touches a chain last-to-first, so a chain's blocks are never less recent
        than the blocks after them and LRU eviction keeps the cached part of a chain a prefix.
        After a :meth:`remove` that no longer holds: a scan from the front, to the first miss.
        """
        lru = self._lru
        if self._holes:
            n = 0
            for h in hashes:
                if h not in lru:
                    break
                n += 1
            return n
        return leading_present(hashes, lru)

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """Record ``hashes`` as cached (most recent); returns the evicted block hashes."""
        lru = self._lru
        touch = lru.move_to_end
        for h in reversed(hashes):
            if h in lru:
                touch(h)
            else:
                lru[h] = None
        evicted = []
        while len(lru) > self.capacity_blocks:
            evicted.append(lru.popitem(last=False)[0])
        return evicted

    def remove(self, hashes: Iterable[int]) -> None:
        """Forget ``hashes`` (the engine evicted them); unknown ones are ignored."""
        pop = self._lru.pop
        for h in hashes:
            pop(h, None)
        self._holes = True

    def clear(self) -> None:
        """Forget everything (the instance restarted or left)."""
        self._lru.clear()


class ClusterCacheModel:
    """``worker_id -> PrefixCacheModel``, created on first use."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._models: dict[str, PrefixCacheModel] = {}
        self._engine_blocks: dict[str, int] = {}
        """worker -> our blocks per engine block, once its events said (``CacheChanged``)."""

    def match(self, worker_id: str, hashes: Sequence[int]) -> int:
        """Cached leading blocks of ``hashes`` on ``worker_id`` (0 for an unknown worker)."""
        model = self._models.get(worker_id)
        return 0 if model is None else model.match(hashes)

    def _model(self, worker_id: str) -> PrefixCacheModel:
        model = self._models.get(worker_id)
        if model is None:
            model = self._models[worker_id] = PrefixCacheModel(self.capacity_blocks)
        return model

    def insert(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Record that ``worker_id`` now caches ``hashes`` (whole engine blocks only, once the
        worker's events told its block size)."""
        per = self._engine_blocks.get(worker_id, 1)
        if per > 1:
            hashes = hashes[:len(hashes) - len(hashes) % per]
        self._model(worker_id).insert(hashes)

    def apply(self, event: CacheChanged) -> None:
        """The worker's engine reported cache changes (cleared, removed, then stored)."""
        wid = event.worker_id
        if event.engine_block_tokens and event.engine_block_tokens % self.block_tokens == 0:
            per = event.engine_block_tokens // self.block_tokens
            self._engine_blocks[wid] = max(self._engine_blocks.get(wid, 1), per)
        if event.cleared:
            model = self._models.get(wid)
            if model is not None:
                model.clear()
        if event.removed:
            model = self._models.get(wid)
            if model is not None:
                model.remove(event.removed)
        if event.stored:
            self._model(wid).insert(event.stored)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Drop the models of workers not in ``worker_ids`` (they left the cluster)."""
        keep = set(worker_ids)
        for wid in [w for w in self._models if w not in keep]:
            del self._models[wid]
            self._engine_blocks.pop(wid, None)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._models
