"""Helpers shared by the peer policies (an internal module).

- a coarser peer block size over our block hashes (chained hashes make every ``k``-th hash the
  hash of a ``k``-times-larger block's prefix);
- seeded, per-request pseudo-random draws that stand in for the peers' ``rand``/``shuffle``
  (a pure function of ``(seed, request_id, ...)``: no global generator, nothing to advance).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policy.base import RouteRequest
from router.policy.hashing import hash_str

_TWO_64 = float(1 << 64)


def coarsen(hashes: Sequence[int], factor: int) -> Sequence[int]:
    """The hashes of ``factor``-block blocks: every ``factor``-th chained hash (full ones only)."""
    return hashes if factor == 1 else hashes[factor - 1::factor]


def blocks_per(peer_block_tokens: int, block_tokens: int) -> int:
    """Our blocks per peer block: the peer's size rounded up to a whole number of ours."""
    return max(1, -(-peer_block_tokens // block_tokens))


def prompt_tokens(request: RouteRequest, hashes: Sequence[int], block_tokens: int) -> int:
    """The prompt length in tokens (at least what its full blocks cover)."""
    return max(request.prompt_len, len(hashes) * block_tokens)


def tie_rank(seed: int, request_id: str, worker_id: str) -> int:
    """A per-request pseudo-random rank of ``worker_id``: sorting tied candidates by it is a
    seeded shuffle, the same for the same request and seed."""
    return hash_str(f"{request_id}\x00{worker_id}", seed)


def uniform(seed: int, request_id: str, salt: str) -> float:
    """A per-request pseudo-random number in [0, 1) (one draw per ``salt``)."""
    return hash_str(f"{request_id}\x01{salt}", seed) / _TWO_64
