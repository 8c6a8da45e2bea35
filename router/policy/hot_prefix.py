"""DualMap's routing key: a prefix of the prompt whose depth grows for hot prefixes.

Parameters (defaults; the constants are the reference code's ``LazyExpansionController``):
- ``block_tokens`` = 16: tokens per hashed block (:mod:`router.policy.hashing`).
- ``level_tokens`` = 512: tokens per key level. The key at depth ``d`` identifies the first
  ``d x 512`` tokens (DualMap hashes 512-token trace blocks; depth 1 = the first block).
- ``window`` = 200: the sliding window of recent requests the detector counts over.
- ``hot_ratio`` = 0.0612: a key carrying at least this share of the window is hot and is
  deepened by one level, so its traffic splits over more instances.
- ``shrink_ratio`` = 0.02: an expanded key whose traffic falls below this share collapses back.
- ``min_samples`` = 20: no expansion before the window holds this many requests.
- ``max_expanded`` = 10,000: expanded keys remembered (LRU), like the reference's per-level LRU.
- ``adaptive`` = True: False gives a fixed depth-1 key (the consistent-hash baselines).

Cluster size (our extension; the reference ran 8-16 instances): ``hot_ratio`` is a fixed share,
so on 1,000 instances a key carrying 4 % of the traffic (40 instances' worth) would stay on its
two candidates. :meth:`PrefixKeyer.resize` lowers the hot share to one instance's fair share,
``min(hot_ratio, 1 / n_instances)`` (at 16 instances 1/16 = 0.0625, the reference's value), and
the shrink share in proportion, and lengthens the window so a hot key still needs the same number
of hits (``hot_ratio x window`` = 12.24) to be seen.

Because block hashes are chained, block ``i``'s hash already names the whole prefix up to it, so
the key at depth ``d`` is simply ``block_hashes[min(d x 32, n) - 1]``. A prompt shorter than one
block is keyed by its length (AIBrix's fallback).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from router.errors import ConfigError
from router.policy.hashing import DEFAULT_BLOCK_TOKENS, hash_int

_SHORT_SEED = 0x51407


class PrefixKeyer:
    """Computes a request's routing key (pure) and learns hot prefixes from ``observe``."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, level_tokens: int = 512,
                 window: int = 200, hot_ratio: float = 0.0612, shrink_ratio: float = 0.02,
                 min_samples: int = 20, max_expanded: int = 10_000,
                 adaptive: bool = True) -> None:
        if level_tokens < block_tokens or level_tokens % block_tokens:
            raise ConfigError(
                f"level_tokens ({level_tokens}) must be a multiple of block_tokens "
                f"({block_tokens})")
        if not 0 < shrink_ratio <= hot_ratio <= 1:
            raise ConfigError("need 0 < shrink_ratio <= hot_ratio <= 1")
        self.level_blocks = level_tokens // block_tokens
        self.base_window = self.window = window
        self.base_hot_ratio = self.hot_ratio = hot_ratio
        self.base_shrink_ratio = self.shrink_ratio = shrink_ratio
        self.min_samples = min_samples
        self.max_expanded = max_expanded
        self.adaptive = adaptive
        self._recent: deque[tuple[int, ...]] = deque()
        self._counts: dict[int, int] = {}  # key -> paths in the window holding it
        self._expanded: OrderedDict[int, None] = OrderedDict()

    def resize(self, n_instances: int) -> None:
        """Scale the hot share and the window to a pool of ``n_instances`` (see module doc)."""
        if n_instances < 1:
            return
        ratio = min(self.base_hot_ratio, 1.0 / n_instances)
        scale = ratio / self.base_hot_ratio
        self.hot_ratio = ratio
        self.shrink_ratio = self.base_shrink_ratio * scale
        self.window = max(self.base_window, round(self.base_window / scale))
        while len(self._recent) > self.window:
            self._forget(self._recent.popleft())

    def _forget(self, old: tuple[int, ...]) -> None:
        counts = self._counts
        for k in old:
            left = counts.get(k, 0) - 1
            if left > 0:
                counts[k] = left
            else:
                counts.pop(k, None)

    def path(self, hashes: Sequence[int], prompt_len: int) -> tuple[int, ...]:
        """The keys at depth 1..d for this prompt; the last one is the routing key."""
        n = len(hashes)
        if n == 0:
            return (hash_int(prompt_len, _SHORT_SEED),)
        step = self.level_blocks
        end = min(step, n)
        keys = [hashes[end - 1]]
        if not self.adaptive:
            return (keys[0],)
        expanded = self._expanded
        while keys[-1] in expanded and end < n:
            end = min(end + step, n)
            keys.append(hashes[end - 1])
        return tuple(keys)

    def key(self, hashes: Sequence[int], prompt_len: int) -> int:
        """The routing key of a prompt (pure)."""
        return self.path(hashes, prompt_len)[-1]

    def is_expanded(self, key: int) -> bool:
        """Whether ``key`` is currently deepened."""
        return key in self._expanded

    def observe(self, hashes: Sequence[int], prompt_len: int) -> None:
        """Count one routed request and expand/shrink keys (state changes happen only here)."""
        if not self.adaptive:
            return
        path = self.path(hashes, prompt_len)
        self._recent.append(path)
        counts = self._counts
        for k in path:
            counts[k] = counts.get(k, 0) + 1
        if len(self._recent) > self.window:
            self._forget(self._recent.popleft())
        size = len(self._recent)
        leaf = path[-1]
        more_blocks = len(hashes) > self.level_blocks * len(path)
        if (size >= self.min_samples and more_blocks
                and counts[leaf] >= self.hot_ratio * size):
            self._expanded[leaf] = None
            self._expanded.move_to_end(leaf)
            if len(self._expanded) > self.max_expanded:
                self._expanded.popitem(last=False)
        for k in path[:-1]:
            if size >= self.min_samples and counts[k] < self.shrink_ratio * size:
                self._expanded.pop(k, None)
