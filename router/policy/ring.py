"""Consistent-hash rings with virtual nodes, and DualMap's pair of independent rings.

Parameters (defaults):
- ``vnodes`` = 100: virtual nodes per instance (AIBrix's DualMap default; the reference Python
  code used uhashring's 160). More vnodes = smoother arcs, bigger ring.
- ``seed``: seeds both the vnode positions and the key hash, so two rings with different seeds
  are independent hash functions. :class:`DualRing` uses ``seed1`` = 0x5EED1 and
  ``seed2`` = 0x5EED2.

A key's owner is the first vnode clockwise of ``hash(key)``. Adding or removing one instance
only moves the keys on the arcs its vnodes own (about 1/N of keys), so the other keys keep
their instance and its warm cache. Lookup can skip instances not in an ``allowed`` set (retries,
cool-down) by walking on clockwise; the walk is deterministic.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Container, Iterable

from router.policy.hashing import hash_int, hash_str

DEFAULT_VNODES = 100
SEED1 = 0x5EED1
SEED2 = 0x5EED2


class HashRing:
    """One consistent-hash ring over instance ids."""

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES,
                 seed: int = SEED1) -> None:
        if vnodes <= 0:
            raise ValueError(f"vnodes must be > 0, got {vnodes}")
        self.vnodes = vnodes
        self.seed = seed
        self._nodes: set[str] = set()
        pts = []
        for node in set(nodes):
            self._nodes.add(node)
            pts.extend(self._points(node))
        pts.sort()
        self._pos = [p for p, _ in pts]
        self._own = [n for _, n in pts]

    def _points(self, node: str) -> list[tuple[int, str]]:
        return [(hash_str(f"{node}#{i}", self.seed), node) for i in range(self.vnodes)]

    @property
    def nodes(self) -> frozenset[str]:
        """The instances on the ring."""
        return frozenset(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, node: str) -> None:
        """Put ``node`` on the ring (no-op when present)."""
        if node in self._nodes:
            return
        self._nodes.add(node)
        for point in self._points(node):
            i = bisect_right(self._pos, point[0])
            # equal positions: order by node id so the ring does not depend on insertion order
            while i > 0 and self._pos[i - 1] == point[0] and self._own[i - 1] > node:
                i -= 1
            self._pos.insert(i, point[0])
            self._own.insert(i, node)

    def remove(self, node: str) -> None:
        """Take ``node`` off the ring (no-op when absent)."""
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        keep = [(p, n) for p, n in zip(self._pos, self._own, strict=True) if n != node]
        self._pos = [p for p, _ in keep]
        self._own = [n for _, n in keep]

    def set_nodes(self, nodes: Iterable[str]) -> None:
        """Make the ring's membership exactly ``nodes`` by adding/removing the difference."""
        want = set(nodes)
        for node in sorted(self._nodes - want):
            self.remove(node)
        for node in sorted(want - self._nodes):
            self.add(node)

    def key_position(self, key: int) -> int:
        """This ring's hash of ``key``."""
        return hash_int(key, self.seed)

    def walk(self, key: int) -> Iterable[str]:
        """Distinct instances clockwise from ``key``'s position (each once)."""
        n = len(self._pos)
        if n == 0:
            return
        start = bisect_right(self._pos, self.key_position(key))
        seen: set[str] = set()
        own = self._own
        for j in range(n):
            node = own[(start + j) % n]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._nodes):
                    return

    def lookup(self, key: int, allowed: Container[str] | None = None,
               exclude: str | None = None) -> str | None:
        """The first instance clockwise of ``key`` that is in ``allowed`` (all when None) and is
        not ``exclude``; None when there is none."""
        n = len(self._pos)
        if n == 0:
            return None
        own = self._own
        i = bisect_right(self._pos, self.key_position(key))
        node = own[i % n]
        if (allowed is None or node in allowed) and node != exclude:
            return node  # the common case: no walk
        for node in self.walk(key):
            if (allowed is None or node in allowed) and node != exclude:
                return node
        return None


class DualRing:
    """Two independent rings over the same instances; a key's candidate pair.

    The pair is ``(ring1.lookup(key), ring2.lookup(key))``; when both rings name the same
    instance, candidate 2 is the next distinct instance clockwise on ring 2 (deterministic,
    like the reference code's "next instance" collision rule).
    """

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES,
                 seed1: int = SEED1, seed2: int = SEED2) -> None:
        nodes = list(nodes)
        self.ring1 = HashRing(nodes, vnodes, seed1)
        self.ring2 = HashRing(nodes, vnodes, seed2)

    @property
    def nodes(self) -> frozenset[str]:
        """The instances on both rings."""
        return self.ring1.nodes

    def __len__(self) -> int:
        return len(self.ring1)

    def add(self, node: str) -> None:
        """Add ``node`` to both rings."""
        self.ring1.add(node)
        self.ring2.add(node)

    def remove(self, node: str) -> None:
        """Remove ``node`` from both rings."""
        self.ring1.remove(node)
        self.ring2.remove(node)

    def set_nodes(self, nodes: Iterable[str]) -> None:
        """Make both rings' membership exactly ``nodes``."""
        nodes = list(nodes)
        self.ring1.set_nodes(nodes)
        self.ring2.set_nodes(nodes)

    def pair(self, key: int, allowed: Container[str] | None = None
             ) -> tuple[str | None, str | None]:
        """The two candidates of ``key`` among ``allowed``: distinct when two exist."""
        first = self.ring1.lookup(key, allowed)
        if first is None:
            return None, None
        return first, self.ring2.lookup(key, allowed, exclude=first)

