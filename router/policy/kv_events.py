"""One engine's KV cache events in this router's block-hash space.

vLLM publishes what its prefix cache holds (``--kv-events-config``): ``BlockStored`` (new full
blocks: their vLLM hashes, the parent block's hash, their token ids and the block size),
``BlockRemoved`` (evicted vLLM hashes) and ``AllBlocksCleared``. vLLM's hashes are its own
(sha256 by default); the router's cache model keys blocks by :func:`hashing.block_hashes`. A
:class:`KVEventTranslator` re-hashes each stored block's tokens into ours and remembers, per
live vLLM block, which of our hashes it holds. Pure: the caller decodes the wire
(``router.state.kv_wire``) and hands each event's fields over.

Parameters (defaults):
- ``block_tokens`` = 16: our block size. The engine's must be a multiple of it (vLLM's default
  is 16 on GPU, 128 on CPU): one engine block is then ``engine / ours`` of our blocks.
- ``max_blocks`` = 262,144 (``MAX_BLOCKS``): live vLLM blocks remembered per engine. A real
  engine removes what it evicts, so it stays far below (its whole KV cache); a publisher that
  only stores (a rogue one, or removals lost) cannot grow the router's memory past it: the
  oldest-stored block is forgotten first and reported removed (counted in ``evicted``).

Semantics:
- stored: our hashes of a vLLM block = ``block_hashes(its tokens, block_tokens, seed=the chain
  state after its parent)``; the chain state after a block is its last hash of ours (before
  the first block: ``salt_seed`` of the request's ``cache_salt``, which vLLM publishes in the
  first block's extra keys; 0 without one). Every stored block is reported (a re-stored block
  is recent again).
- a ``BlockStored`` whose parent this translator never saw (it subscribed after the parent was
  stored, or lost messages) cannot be hashed: our chain needs the whole prefix's tokens. It is
  ignored and counted in :attr:`KVEventTranslator.orphans`; so are its descendants.
- copies: a vLLM hash may be stored more than once (two blocks of equal content, a GPU and an
  offloaded CPU copy, several KV cache groups), and two vLLM hashes may carry the same tokens
  (a ``cache_salt``, a LoRA): our hashes are reference-counted and reported removed only when
  their last live copy goes.
- removed: unknown vLLM hashes (stored before we subscribed) are ignored.
- not supported: vLLM's per-request ``kv_cache_report_mode="full"`` re-reports reused blocks as
  ``BlockStored`` without a matching removal; they would count as extra copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from router.errors import ConfigError
from router.policy.base import CacheChanged
from router.policy.hashing import DEFAULT_BLOCK_TOKENS, block_hashes, salt_seed

EngineHash = Hashable
"""A vLLM block hash as published: ``bytes`` (sha256) or ``int``."""

MAX_BLOCKS = 262_144
"""Default cap on the live vLLM blocks one translator remembers (security review finding 9)."""


@dataclass
class _Block:
    ours: tuple[int, ...]
    chain: int
    copies: int


class KVEventTranslator:
    """One worker's vLLM KV events -> :class:`CacheChanged` in our hash space."""

    def __init__(self, worker_id: str, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 max_blocks: int = MAX_BLOCKS) -> None:
        if block_tokens <= 0:
            raise ConfigError(f"block_tokens must be > 0, got {block_tokens}")
        if max_blocks <= 0:
            raise ConfigError(f"max_blocks must be > 0, got {max_blocks}")
        self.worker_id = worker_id
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.engine_block_tokens = 0
        """The engine's block size: the largest ``BlockStored.block_size`` seen so far."""
        self.orphans = 0
        """``BlockStored`` events ignored because their parent block was unknown."""
        self.evicted = 0
        """Blocks forgotten to stay within ``max_blocks`` (reported removed)."""
        self._blocks: dict[EngineHash, _Block] = {}
        self._refs: dict[int, int] = {}

    @property
    def live_blocks(self) -> int:
        """Distinct vLLM blocks the events say are cached."""
        return len(self._blocks)

    @property
    def live_hashes(self) -> int:
        """Distinct hashes of ours the events say are cached."""
        return len(self._refs)

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` (ours) that the events say are cached."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def check_block_size(self, engine_block_tokens: int) -> None:
        """Raise :class:`ConfigError` unless the engine's block size is a multiple of ours."""
        if engine_block_tokens <= 0 or engine_block_tokens % self.block_tokens:
            raise ConfigError(
                f"worker {self.worker_id}: its KV block size ({engine_block_tokens} tokens) is "
                f"not a multiple of the router's {self.block_tokens}-token blocks; its KV events "
                "cannot be mapped onto the router's prefix hashes (start vLLM with a "
                f"--block-size that is a multiple of {self.block_tokens}, or run the router "
                "without --kv-events)")

    def stored(self, engine_hashes: Sequence[EngineHash], parent: EngineHash | None,
               token_ids: Sequence[int], engine_block_tokens: int,
               salt: str | None = None) -> CacheChanged | None:
        """A ``BlockStored``; None when it is an orphan (unknown parent) or empty. ``salt``:
        the ``cache_salt`` of a chain's first block (ignored when ``parent`` is given)."""
        if engine_block_tokens != self.engine_block_tokens:
            self.check_block_size(engine_block_tokens)
            # vLLM also caches partial blocks (shorter events): the largest size is the block's
            self.engine_block_tokens = max(self.engine_block_tokens, engine_block_tokens)
        if parent is None:
            chain = salt_seed(salt)
        else:
            known = self._blocks.get(parent)
            if known is None:
                self.orphans += 1
                return None
            chain = known.chain
        per_block = engine_block_tokens // self.block_tokens
        whole = min(len(engine_hashes), len(token_ids) // engine_block_tokens)
        if not whole:
            return None
        ours = block_hashes(token_ids[:whole * engine_block_tokens], self.block_tokens,
                            seed=chain)
        refs = self._refs
        gone: list[int] = []
        for i in range(whole):
            block = self._blocks.get(engine_hashes[i])
            if block is not None:
                block.copies += 1
                continue
            if len(self._blocks) >= self.max_blocks:
                gone.extend(self._forget(next(iter(self._blocks))))
                self.evicted += 1
            mine = ours[i * per_block:(i + 1) * per_block]
            self._blocks[engine_hashes[i]] = _Block(mine, mine[-1], 1)
            for h in mine:
                refs[h] = refs.get(h, 0) + 1
        if gone:  # the cap forgot older blocks (or, with a tiny cap, some of these)
            ours = tuple(h for h in ours if h in refs)
        return CacheChanged(self.worker_id, stored=ours,
                            removed=tuple(h for h in gone if h not in refs),
                            engine_block_tokens=self.engine_block_tokens)

    def removed(self, engine_hashes: Sequence[EngineHash]) -> CacheChanged | None:
        """A ``BlockRemoved``; None when none of our hashes lost its last copy."""
        gone: list[int] = []
        for engine_hash in engine_hashes:
            block = self._blocks.get(engine_hash)
            if block is None:
                continue
            block.copies -= 1
            if not block.copies:
                gone.extend(self._forget(engine_hash))
        return CacheChanged(self.worker_id, removed=tuple(gone)) if gone else None

    def _forget(self, engine_hash: EngineHash) -> list[int]:
        """Drop a vLLM block; our hashes whose last live copy it was."""
        block = self._blocks.pop(engine_hash)
        refs = self._refs
        gone = []
        for h in block.ours:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
                gone.append(h)
        return gone

    def cleared(self) -> CacheChanged:
        """An ``AllBlocksCleared``: the engine's prefix cache is empty."""
        self._blocks.clear()
        self._refs.clear()
        return CacheChanged(self.worker_id, cleared=True)
