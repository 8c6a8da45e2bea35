"""The simulated instances and the two pools that hold them.

Each pool is the ledger of its :class:`router.placement.Pool` (``start`` / ``finish`` count a
dispatch as the router's ``LoadTracker`` does) and offers the candidates its placement pool
chooses among, built from the instances' state:

- :class:`PrefillPool`: in-flight requests and the router's estimate of uncached tokens pending
  per instance; candidates are built lazily, so a 1,000-instance pool costs nothing until a
  policy looks at a member;
- :class:`DecodePool`: running sequences per instance, kept in a heap ordered by
  ``(running, index)`` so the decode policy finds the least loaded one in O(log n)
  (:class:`router.policy.base.LoadOrdered`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping, Sequence

from bench.sim.workload import SimRequest
from router.policy.base import Candidate, LoadOrdered, RouteRequest
from router.policy.cache_model import PrefixCacheModel

# instance life cycle
STARTING, READY, DRAINING, STOPPED = 0, 1, 2, 3


class Job:
    """One request on its way through the simulated cluster."""

    __slots__ = ("req", "route", "est", "alt", "arrival", "cached", "uncached", "worker")

    def __init__(self, req: SimRequest, route: RouteRequest, arrival: float) -> None:
        self.req = req
        self.route = route
        self.arrival = arrival
        self.est = 0
        """Uncached tokens the placement counted for it on its prefill instance."""
        self.alt: str | None = None
        """The placement's alternate prefill instance (rebalancing target)."""
        self.cached = 0
        self.uncached = 0
        self.worker = ""


class Instance:
    """Billing and life cycle shared by both roles."""

    __slots__ = ("wid", "state", "start_s", "stop_s")

    def __init__(self, wid: str, state: int, start_s: float) -> None:
        self.wid = wid
        self.state = state
        self.start_s = start_s
        self.stop_s: float | None = None

    def billed_s(self, end_s: float) -> float:
        """Seconds billed from start to stop (or ``end_s``)."""
        return (end_s if self.stop_s is None else self.stop_s) - self.start_s


class PrefillInstance(Instance):
    """A FIFO queue served in batches, with its true prefix cache."""

    __slots__ = ("queue", "busy", "batch", "cache", "pending", "in_flight", "busy_s",
                 "batch_est", "batch_start")

    def __init__(self, wid: str, cache_blocks: int, state: int = READY,
                 start_s: float = 0.0) -> None:
        super().__init__(wid, state, start_s)
        self.queue: deque[Job] = deque()
        self.busy = False
        self.batch: list[Job] = []
        self.batch_est = 0
        self.batch_start = 0.0
        self.cache = PrefixCacheModel(cache_blocks)
        self.pending = 0  # router's estimate of uncached tokens dispatched, not finished
        self.in_flight = 0
        self.busy_s = 0.0


class DecodeInstance(Instance):
    """Running sequences and the tokens in their contexts."""

    __slots__ = ("index", "running", "ctx")

    def __init__(self, index: int, state: int = READY, start_s: float = 0.0) -> None:
        super().__init__(f"d{index:04d}", state, start_s)
        self.index = index
        self.running = 0
        self.ctx = 0


class _LazyIndex(Mapping[str, Candidate]):
    """``worker_id -> Candidate`` built on access."""

    def __init__(self, inst: dict[str, PrefillInstance]) -> None:
        self._inst = inst

    def __getitem__(self, wid: str) -> Candidate:
        p = self._inst[wid]
        return Candidate(wid, p.in_flight, False, p.pending)

    def __contains__(self, wid: object) -> bool:
        return wid in self._inst

    def __iter__(self) -> Iterator[str]:
        return iter(self._inst)

    def __len__(self) -> int:
        return len(self._inst)


class _LazyPool(Sequence[Candidate]):
    any_failed = False

    def __init__(self, inst: dict[str, PrefillInstance]) -> None:
        self.by_id = _LazyIndex(inst)
        self._ids = list(inst)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        if isinstance(i, slice):
            return [self.by_id[w] for w in self._ids[i]]
        return self.by_id[self._ids[i]]

    def __iter__(self) -> Iterator[Candidate]:
        return (self.by_id[w] for w in self._ids)


class PrefillPool:
    """Every prefill instance ever started, the routable ones, and their dispatch ledger."""

    def __init__(self, cache_blocks: int) -> None:
        self.cache_blocks = cache_blocks
        self.all: dict[str, PrefillInstance] = {}
        """Every instance ever started (billing, busy time)."""
        self.routable: dict[str, PrefillInstance] = {}
        """Ready and not draining: what placement may choose."""
        self.candidates: Sequence[Candidate] = _LazyPool(self.routable)
        self._tokens: dict[str, int] = {}  # request id -> uncached tokens counted

    def add(self, state: int = READY, start_s: float = 0.0) -> PrefillInstance:
        """A new instance (routable at once when READY)."""
        wid = f"p{len(self.all):04d}"
        p = self.all[wid] = PrefillInstance(wid, self.cache_blocks, state, start_s)
        if state == READY:
            self.routable[wid] = p
        return p

    def refresh(self) -> None:
        """Rebuild the candidates after ``routable`` changed."""
        self.candidates = _LazyPool(self.routable)

    def start(self, worker_id: str, request_id: str | None = None, tokens: int = 0,
              *, prefill: bool = False) -> None:
        """Ledger: a request was placed on ``worker_id`` with ``tokens`` uncached."""
        p = self.all[worker_id]
        p.pending += tokens
        p.in_flight += 1
        if request_id is not None:
            self._tokens[request_id] = tokens

    def finish(self, worker_id: str, request_id: str | None = None) -> None:
        """Ledger: ``worker_id`` is done with the request (prefilled or moved away)."""
        p = self.all[worker_id]
        p.in_flight -= 1
        if request_id is not None:
            p.pending -= self._tokens.pop(request_id, 0)


class _DecodeCandidates(LoadOrdered):
    """The ready decode instances as candidates, least loaded first on request."""

    def __init__(self, pool: DecodePool) -> None:
        self._pool = pool

    def _ready(self) -> list[DecodeInstance]:
        return [d for d in self._pool.instances if d.state == READY]

    def __len__(self) -> int:
        return len(self._ready())

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        ready = self._ready()
        if isinstance(i, slice):
            return [_candidate(d) for d in ready[i]]
        return _candidate(ready[i])

    def __iter__(self) -> Iterator[Candidate]:
        return (_candidate(d) for d in self._ready())

    def least_loaded(self) -> Candidate | None:
        """:class:`router.policy.base.LoadOrdered`: the ready instance with the fewest running
        sequences (ties: lowest index = lowest worker id)."""
        d = self._pool.least_running()
        return None if d is None else _candidate(d)


def _candidate(d: DecodeInstance) -> Candidate:
    return Candidate(d.wid, d.running, False, 0, d.running)


class DecodePool:
    """Decode instances with a heap of ``(running, index)``, lazily invalidated (a stale count
    or an instance no longer READY is dropped when it reaches the top)."""

    def __init__(self, n: int) -> None:
        self.instances = [DecodeInstance(i) for i in range(n)]
        self._heap = [(0, i) for i in range(n)]
        self.candidates = _DecodeCandidates(self)

    def add(self, state: int, start_s: float) -> DecodeInstance:
        """A new instance (starting)."""
        d = DecodeInstance(len(self.instances), state, start_s)
        self.instances.append(d)
        return d

    def ready(self, d: DecodeInstance) -> None:
        """``d`` (READY now) joins the heap."""
        heapq.heappush(self._heap, (d.running, d.index))

    def ready_ids(self) -> list[str]:
        """Worker ids of the serving instances."""
        return [d.wid for d in self.instances if d.state == READY]

    def least_running(self) -> DecodeInstance | None:
        """The READY instance with the fewest running sequences (ties: lowest index)."""
        heap, dec = self._heap, self.instances
        while heap:
            running, i = heap[0]
            d = dec[i]
            if d.state != READY:
                heapq.heappop(heap)
            elif running != d.running:
                heapq.heapreplace(heap, (d.running, i))
            else:
                return d
        return None

    def of(self, worker_id: str) -> DecodeInstance:
        """The instance named ``worker_id``."""
        return self.instances[int(worker_id[1:])]

    def start(self, worker_id: str, request_id: str | None = None, tokens: int = 0,
              *, prefill: bool = False) -> None:
        """Ledger: one more running sequence on ``worker_id``."""
        d = self.of(worker_id)
        d.running += 1
        heap = self._heap
        if heap and heap[0][1] == d.index:
            heapq.heapreplace(heap, (d.running, d.index))
        else:
            heapq.heappush(heap, (d.running, d.index))

    def finish(self, worker_id: str, request_id: str | None = None) -> None:
        """Ledger: one sequence fewer on ``worker_id``."""
        d = self.of(worker_id)
        d.running -= 1
        if d.state == READY:
            heapq.heappush(self._heap, (d.running, d.index))
