"""Router-side model of each instance's prefix cache: a bounded LRU of block hashes.

Parameters (defaults):
- ``capacity_blocks`` = 20,000: blocks remembered per instance (20,000 x 16 tokens = 320k tokens,
  about the KV room of an 8B model on one 80 GB GPU). The GIE prefix scorer's default is 31,250.
- ``block_tokens`` = 16: tokens per block; must match the hashing.

The model is an estimate: the router records what it sent where, it does not see the engine's
evictions. ``insert`` touches the blocks last-to-first so a prompt's first blocks are the most
recently used and the tail is evicted first (as vLLM does), which keeps "cached" a prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY_BLOCKS = 20_000


class PrefixCacheModel:
    """One instance's LRU set of block hashes."""

    __slots__ = ("capacity_blocks", "_lru")

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` present (the reusable cached prefix).

        A binary search: chained hashes make block ``i``'s hash name the whole prefix ``0..i``,
        and ``insert`` touches a chain last-to-first, so a chain's blocks are never less recent
        than the blocks after them and LRU eviction keeps the cached part of a chain a prefix.
        """
        lru = self._lru
        lo, hi = 0, len(hashes)  # hashes[:lo] cached; hashes[hi] (if any) known absent
        if hi and hashes[0] not in lru:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

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

    def clear(self) -> None:
        """Forget everything (the instance restarted or left)."""
        self._lru.clear()


class ClusterCacheModel:
    """``worker_id -> PrefixCacheModel``, created on first use."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.capacity_blocks = capacity_blocks
        self._models: dict[str, PrefixCacheModel] = {}

    def match(self, worker_id: str, hashes: Sequence[int]) -> int:
        """Cached leading blocks of ``hashes`` on ``worker_id`` (0 for an unknown worker)."""
        model = self._models.get(worker_id)
        return 0 if model is None else model.match(hashes)

    def insert(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Record that ``worker_id`` now caches ``hashes``."""
        model = self._models.get(worker_id)
        if model is None:
            model = self._models[worker_id] = PrefixCacheModel(self.capacity_blocks)
        model.insert(hashes)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Drop the models of workers not in ``worker_ids`` (they left the cluster)."""
        keep = set(worker_ids)
        for wid in [w for w in self._models if w not in keep]:
            del self._models[wid]

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._models
