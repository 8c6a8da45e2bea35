"""Which prefixes warm a worker that joined a pool (issue 25, "warm before traffic"), pure.

A new instance's prefix cache starts empty, so the requests placement now sends it recompute
prompts that a peer already caches. The plan: walk the pool's recent requests, newest first;
for each one placement would send to a target, warm the leading blocks of its prompt that
some peer caches beyond what the target (or an earlier entry of its plan) already covers, until
the target's budget of blocks is spent. The router sends each planned prefix as a one-token
request (``router/api/warm.py``); the simulator pulls it at the KV transfer cost
(``bench/sim/engine.py``). Both ask the same placement object which requests go where.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.policy.base import RouteRequest


@dataclass(frozen=True)
class WarmPrefix:
    """Warm the first ``blocks`` blocks of ``route``'s prompt (``new_blocks`` of them not yet
    covered on the target)."""

    route: RouteRequest
    blocks: int
    new_blocks: int


def plan_warm(recent: Sequence[RouteRequest], choose: Callable[[RouteRequest], str | None],
              takes: Callable[[str], bool], have: Callable[[RouteRequest, str], int],
              held: Callable[[RouteRequest, str], int],
              hashes: Callable[[RouteRequest], Sequence[int]], budget_blocks: int
              ) -> dict[str, list[WarmPrefix]]:
    """Each target's prefixes to warm, newest request first.

    ``recent``: the pool's recent requests, oldest first. ``choose``: the worker placement
    would send a request to (the router asks for its spill target: where it goes when the
    workers caching it are busy; None: none). ``takes``: whether a worker is being warmed.
    ``have``/``held``: leading blocks of a request the target caches / the most any peer of it
    caches. ``hashes``: a request's chained block hashes (dedup: two requests sharing a prefix
    warm it once). At most ``budget_blocks`` new blocks per target; the entry that crosses the
    budget is kept whole.
    """
    plans: dict[str, list[WarmPrefix]] = {}
    spent: dict[str, int] = {}
    covered: dict[str, set[int]] = {}
    for route in reversed(recent):
        target = choose(route)
        if target is None or not takes(target) or spent.get(target, 0) >= budget_blocks:
            continue
        best = held(route, target)
        if best <= 0:
            continue
        chain = hashes(route)[:best]
        done = covered.setdefault(target, set())
        start = have(route, target)
        while start < len(chain) and chain[start] in done:
            start += 1
        if start >= len(chain):
            continue
        done.update(chain)
        plans.setdefault(target, []).append(WarmPrefix(route, len(chain), len(chain) - start))
        spent[target] = spent.get(target, 0) + len(chain) - start
    return plans
