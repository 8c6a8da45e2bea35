"""Hotspot-aware rebalancing: move queued requests off an overloaded instance.

Parameters (defaults):
- ``threshold_s`` (the caller passes the TTFT SLO; DualMap's ``rebalance_threshold`` = 1.0 x SLO):
  an instance whose predicted drain time (tokens running + queued, x per_token_s) exceeds it is
  a hotspot.
- ``max_moves`` = 64: most moves planned per call.
- the :class:`~router.policy.load_model.LoadModel` (``per_token_s``).

Model: each instance runs ``ahead_tokens`` of unmovable work, then serves its queue FIFO. A queued
request's predicted TTFT = (tokens ahead of it + its own uncached tokens) x per_token_s. The total
predicted TTFT is the sum over every queued request. Moving request ``r`` from position ``k`` of
source ``S`` to the tail of its alternate candidate ``T`` changes the total by

    delta = TTFT_T(tail + r) - TTFT_S(r at k) - (requests behind r on S) x tokens_S(r) x per_token_s

and a move is made only when ``delta < 0``, greedily (most negative first), each request at most
once per call (no cascades, as in the reference code), until the source is no longer a hotspot.
So a plan never increases the total predicted TTFT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.policy.load_model import LoadModel


@dataclass(frozen=True)
class QueuedRequest:
    """One request waiting (not started) on the source instance."""

    request_id: str
    tokens: int
    """Uncached tokens on the source instance."""
    alternate: str | None
    """Its other DualMap candidate; None = cannot move."""
    alternate_tokens: int
    """Uncached tokens if it ran on ``alternate`` (its cache there may differ)."""


@dataclass(frozen=True)
class Move:
    """Move ``request_id`` from ``source`` to the tail of ``target``'s queue."""

    request_id: str
    source: str
    target: str
    delta_s: float
    """Change of the total predicted TTFT (negative)."""


def plan_rebalance(
    source: str,
    queue: Sequence[QueuedRequest],
    source_ahead_tokens: int,
    tail_tokens: Mapping[str, int],
    load: LoadModel,
    threshold_s: float,
    max_moves: int = 64,
) -> list[Move]:
    """Moves that relieve ``source`` (pure).

    ``source_ahead_tokens`` is the source's unmovable work ahead of its queue; ``tail_tokens``
    maps each possible target to all the tokens ahead of a request appended to its queue now.
    """
    c = load.per_token_s
    items = list(queue)
    tokens = [q.tokens for q in items]
    tails = dict(tail_tokens)
    total = source_ahead_tokens + sum(tokens)
    moved: set[int] = set()
    moves: list[Move] = []
    while load.queue_s(total) > threshold_s and len(moves) < max_moves:
        best: tuple[float, int] | None = None
        ahead = source_ahead_tokens
        behind = len(items) - len(moved)
        for i, q in enumerate(items):
            if i in moved:
                continue
            behind -= 1
            if q.alternate is not None and q.alternate != source and q.alternate in tails:
                before = (ahead + q.tokens) * c
                after = (tails[q.alternate] + q.alternate_tokens) * c
                delta = after - before - behind * q.tokens * c
                if delta < 0 and (best is None or delta < best[0]):
                    best = (delta, i)
            ahead += q.tokens
        if best is None:
            break
        delta, i = best
        q = items[i]
        moved.add(i)
        total -= q.tokens
        assert q.alternate is not None
        tails[q.alternate] += q.alternate_tokens
        moves.append(Move(q.request_id, source, q.alternate, delta))
    return moves


def total_predicted_ttft(queues: Mapping[str, Sequence[int]], ahead: Mapping[str, int],
                         load: LoadModel) -> float:
    """Sum of predicted TTFTs of every queued request (FIFO per instance), in seconds."""
    total = 0.0
    for wid, toks in queues.items():
        pending = ahead.get(wid, 0)
        for t in toks:
            total += load.ttft_s(pending, t)
            pending += t
    return total
