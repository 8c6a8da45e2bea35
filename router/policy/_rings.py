"""Per-model dual rings shared by the ring-based policies (an internal helper).

Membership comes from ``Membership`` events. A caller that never sends one (a unit test, a
one-off call) still gets a ring: it is built from the candidate ids and memoised by that id set.
The memo is a cache, not decision state: the same inputs always give the same ring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from router.policy.base import Candidate
from router.policy.ring import DEFAULT_VNODES, DualRing

_MEMO_SIZE = 8


class ModelRings:
    """``model -> DualRing``."""

    def __init__(self, vnodes: int = DEFAULT_VNODES) -> None:
        self.vnodes = vnodes
        self._rings: dict[str, DualRing] = {}
        self._memo: dict[frozenset[str], DualRing] = {}

    def set_members(self, model: str, worker_ids: tuple[str, ...]) -> None:
        """Apply a membership change: only the joining/leaving instances' arcs move."""
        ring = self._rings.get(model)
        if ring is None:
            self._rings[model] = DualRing(worker_ids, self.vnodes)
        else:
            ring.set_nodes(worker_ids)

    def ring(self, model: str, index: Mapping[str, Candidate]) -> DualRing:
        """The model's ring, or one memoised from the candidate ids when none was announced."""
        ring = self._rings.get(model)
        if ring is not None and len(ring):
            return ring
        ids = frozenset(index)
        memo = self._memo.get(ids)
        if memo is None:
            if len(self._memo) >= _MEMO_SIZE:
                self._memo.pop(next(iter(self._memo)))
            memo = self._memo[ids] = DualRing(ids, self.vnodes)
        return memo


def allowed_ids(candidates: Sequence[Candidate],
                index: Mapping[str, Candidate]) -> Mapping[str, Candidate]:
    """Candidates not in failure cool-down, or all when every one is cooling down. A pool that
    knows it has no failed member (``any_failed`` False) is returned without a scan."""
    if getattr(candidates, "any_failed", True) is False:
        return index
    for c in index.values():
        if c.recently_failed:
            break
    else:
        return index
    healthy = {w: c for w, c in index.items() if not c.recently_failed}
    return healthy or index
