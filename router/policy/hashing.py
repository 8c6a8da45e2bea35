"""Prompt hashing: chained hashes over fixed-size token blocks (vLLM's prefix-cache idea).

Parameters (defaults):
- ``block_tokens`` = 16: tokens per block, like vLLM's default KV block. Only full blocks are
  hashed; a trailing partial block is never cached by the engine either.
- ``seed`` = 0: seed of the first block's hash; every later block is hashed with the previous
  block's hash as its seed, so block ``i``'s hash identifies the whole prefix ``tokens[:16(i+1)]``.
  A request with a vLLM ``cache_salt`` starts from :func:`salt_seed` of it instead, as vLLM
  mixes the salt into its first block's hash: equal prompts under different salts share no
  block, here as in the engine.

Hash function: xxHash3-64 (non-cryptographic, stable across processes and platforms; Python's
``hash()`` is salted per process and must never be used for routing). Token ids are encoded as
little-endian unsigned 32-bit integers.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from router.policy.base import RouteRequest

DEFAULT_BLOCK_TOKENS = 16
_MASK64 = (1 << 64) - 1
_xxh = xxhash.xxh3_64_intdigest


def block_hashes(
    token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, seed: int = 0
) -> tuple[int, ...]:
    """Chained 64-bit hashes of every full ``block_tokens``-token block of ``token_ids``."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    n_blocks = len(token_ids) // block_tokens
    if n_blocks == 0:
        return ()
    data = array("I", token_ids[: n_blocks * block_tokens]).tobytes()
    step = 4 * block_tokens
    out: list[int] = []
    h = seed & _MASK64
    for i in range(n_blocks):
        h = _xxh(data[i * step:(i + 1) * step], h)
        out.append(h)
    return tuple(out)


def salt_seed(salt: object) -> int:
    """The chain seed of a prompt sent with ``cache_salt`` = ``salt`` (0: no salt, or not a
    non-empty string, which vLLM refuses anyway)."""
    if not isinstance(salt, str) or not salt:
        return 0
    return _xxh(b"cache_salt\x00" + salt.encode(), 0)


def hash_int(value: int, seed: int) -> int:
    """A seeded 64-bit hash of a 64-bit integer (ring positions, keys)."""
    return _xxh((value & _MASK64).to_bytes(8, "little"), seed)


def hash_ints(values: range, seed: int) -> list[int]:
    """:func:`hash_int` of every value of ``values`` (one call for a run of them)."""
    return [_xxh((v & _MASK64).to_bytes(8, "little"), seed) for v in values]


def hash_str(value: str, seed: int) -> int:
    """A seeded 64-bit hash of a string (virtual node names)."""
    return _xxh(value.encode(), seed)


def request_hashes(request: RouteRequest, block_tokens: int) -> Sequence[int]:
    """The request's chained block hashes: given (the simulator), or computed from its token
    ids at ``block_tokens`` per block."""
    if request.block_hashes or not request.prompt_token_ids:
        return request.block_hashes
    return block_hashes(request.prompt_token_ids, block_tokens)
