"""Re-dispatch in the real router: a request still waiting in a worker's queue moves to a worker
of its pool that can start it sooner (one that joined, or went idle). Issue 25's router half;
the simulator's :class:`bench.sim.engine.Moves` runs the same rule through the same placement
object.

Which requests wait. A stream the router can move (:class:`router.api.resume.ResumableStream`)
is *waiting* on its worker from the moment its request is sent until the worker's first chunk.
Not all of those are still queued in the engine: vLLM also sends nothing while it prefills a
request it already scheduled. The worker's own ``vllm:num_requests_waiting`` (the load poller's
scrape) says how many it still queues; vLLM admits FIFO, so those are the newest ``waiting`` of
the requests the router had sent before that scrape (:func:`queued_now`). Only those move:
running work never does.

The rule (pure, :func:`router.policy.rebalance.plan_redispatch`, as the simulator runs it):
each queued request's predicted TTFT is the work ahead of it on its worker plus its own; a move
to a target's tail is made only when it lowers the total predicted TTFT over every queued
request, greedily, each request at most once in its life. Targets are the pool's workers that
joined (even if new arrivals already reached them: until a move to them is made, at most
``JOIN_WINDOW_S`` after the join; no load report needed) or are idle (nothing running
or queued, by their report and the router's ledger), that queue nothing by their last report,
are not leaving and did not just fail. A step runs every ``interval_s`` and at once when a
worker joins, inside the membership update that adds it (``ClusterSource.on_join``): the queue
it can take is planned before any new arrival is placed on it. Without that, on a fast engine
new arrivals balanced the old worker's queue within a second of the join, ahead of requests
that had waited longer (CI run 21's compose cluster: a 96-token request per 0.4 s). Work is counted
in the pool's unit: prefill roles (prefill, aggregated) in uncached prompt tokens, the
router's ledger on the source and the pool policy's cache estimate on each target (a joined
worker: nothing cached), so a move that breaks a long prefix hit is not made; decode in
sequences (a queued decode starts when a sequence ahead of it ends; a moved one computes its
prompt on the target, which a count of 1 understates for a long prompt; see the README).

Flex workers (an adaptive fleet, ``router.policy.adaptive``) are neither sources nor targets:
the path policy plans each of their requests from the engines' queues and the split it keeps
(quiet decoders that prefill nothing), which this rule does not see, and vLLM counts a decode
that is pulling its KV as waiting. Seen once on the switching goodput trace (2 flex engines,
1.5 req/s, 107 requests): while the quiet decoder's releases hung (an endpoint pairing bug of
the native engine, since fixed), re-dispatch moved 12 of its decodes onto the engine the split
kept prefilling, each recomputing its prompt there.

How a move runs: the stream closes its connection (vLLM aborts a request whose client left; a
decode that got ``kv_transfer_params`` and never pulled releases the prefill's lease) and sends
the request again to the target, nothing having reached the client from the source
(ARCHITECTURE's "Paths" re-plan). It is counted by ``pdserve_router_redispatches_total`` and
listed in the timeline's ``moves`` with reason ``redispatch``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.policy.base import RouteRequest
from router.policy.load_model import LoadModel
from router.policy.rebalance import InstanceQueue, Move, QueuedRequest, plan_redispatch
from router.state.cluster import cancel_task
from router.state.registry import WorkerRecord
from router.state.worker_load import WorkerLoad

if TYPE_CHECKING:
    from router.api.proxy import PDProxy

logger = logging.getLogger(__name__)

PREFILL_ROLES = ("prefill", "aggregated")
"""Pools whose queued work is counted in uncached prompt tokens (decode: in sequences); flex
workers are left to the path policy (module doc)."""
JOIN_WINDOW_S = 10.0
"""How long a worker counts as joined while no move to it was made."""
SEQUENCE = LoadModel(per_token_s=1.0)
"""The decode pool's unit: one sequence (only the sign of a move's gain matters)."""


@dataclass(eq=False)
class Waiting:
    """A request sent to ``worker_id`` that has had no answer chunk yet."""

    route: RouteRequest
    role: str
    """The pool that booked the worker."""
    worker_id: str
    sent_s: float
    """Monotonic time the request was sent."""
    move_to: Callable[[WorkerRecord], bool] = field(repr=False)
    """Ask the request to move to a worker; False when it no longer can."""


class Redispatch(Exception):
    """Re-dispatch moved a request that waited for its worker's answer to ``target``
    (raised by ``PDProxy.watched``; the caller books and sends it there)."""

    def __init__(self, target: WorkerRecord) -> None:
        super().__init__(f"moved to {target.worker_id}")
        self.target = target


class WaitingRequests:
    """The requests waiting on each worker, oldest first."""

    def __init__(self) -> None:
        self._on: dict[str, dict[Waiting, None]] = {}

    def add(self, entry: Waiting) -> None:
        """``entry`` was sent and has had no answer yet."""
        self._on.setdefault(entry.worker_id, {})[entry] = None

    def discard(self, entry: Waiting) -> None:
        """``entry`` got its first chunk, moved or ended."""
        entries = self._on.get(entry.worker_id)
        if entries is not None:
            entries.pop(entry, None)
            if not entries:
                del self._on[entry.worker_id]

    def on(self, worker_id: str) -> list[Waiting]:
        """The requests waiting on ``worker_id``, oldest first."""
        return list(self._on.get(worker_id, ()))

    def workers(self) -> list[str]:
        """Workers with a request waiting on them."""
        return list(self._on)


def queued_now(entries: Sequence[Waiting], load: WorkerLoad | None) -> list[Waiting]:
    """The entries the worker still queues (pure): the newest ``load.waiting`` of those sent
    before its scrape (vLLM admits FIFO); none without a report."""
    if load is None or load.waiting <= 0:
        return []
    before = [e for e in entries if e.sent_s < load.scraped_at_s]
    return before[-load.waiting:]


class Redispatcher:
    """Every ``interval_s``, moves the queued requests that :func:`plan_redispatch` says gain
    by it (see the module docstring)."""

    def __init__(self, proxy: PDProxy, interval_s: float, per_token_s: float,
                 max_moves: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self.proxy = proxy
        self.interval_s = interval_s
        self.tokens = LoadModel(per_token_s=per_token_s)
        self.max_moves = max_moves
        """Most moves planned per pool and step."""
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._members: dict[tuple[str, str], set[str]] = {}
        """Each pool's members at the last step (who joined since)."""
        self._joined: dict[tuple[str, str], dict[str, float]] = {}
        """Workers that joined, and when, no move to them made yet (``JOIN_WINDOW_S``)."""

    def step(self) -> int:
        """Plan and ask for this moment's moves; returns how many requests agreed to move (a
        request that answers before it notices stays: only a move made is counted)."""
        proxy = self.proxy
        loads = proxy.reported_loads()
        joined = self._new_members()
        groups: dict[tuple[str, str], list[tuple[str, list[Waiting]]]] = {}
        flex = self._flex()
        for wid in proxy.waiting.workers():
            if wid in flex:  # an adaptive fleet's requests stay on their planned path
                continue
            queued = queued_now(proxy.waiting.on(wid), loads.get(wid))
            by_pool: dict[tuple[str, str], list[Waiting]] = {}
            for entry in queued:
                by_pool.setdefault((entry.role, entry.route.model), []).append(entry)
            for key, entries in by_pool.items():
                groups.setdefault(key, []).append((wid, entries))
        moved = 0
        for (role, model), sources in groups.items():
            moved += self._move(role, model, sources, loads, joined.setdefault((role, model), {}),
                                flex)
        return moved

    def _flex(self) -> set[str]:
        """Every flex worker's id (neither a source nor a target: module doc)."""
        return {r.worker_id for r in self.proxy.cluster.workers("flex")}

    def _new_members(self) -> dict[tuple[str, str], dict[str, float]]:
        """Each pool's workers that joined since an earlier step (none at the first), no move
        to them made yet, within ``JOIN_WINDOW_S`` of the join."""
        proxy, now = self.proxy, self._clock()
        for model in proxy.cluster.models():
            for role in (*PREFILL_ROLES, "decode"):
                key = (role, model)
                members = {r.worker_id for r in proxy.live(role, model)}
                new = self._joined.setdefault(key, {})
                for wid in members - self._members.get(key, members):
                    new[wid] = now
                for wid in [w for w, at in new.items()
                            if w not in members or now - at > JOIN_WINDOW_S]:
                    del new[wid]
                self._members[key] = members
        return self._joined

    def _move(self, role: str, model: str, sources: list[tuple[str, list[Waiting]]],
              loads: Mapping[str, WorkerLoad], joined: dict[str, float],
              flex: set[str]) -> int:
        proxy = self.proxy
        live = {r.worker_id: r for r in proxy.live(role, model)
                if not proxy.cluster.leaving(r.worker_id) and r.worker_id not in flex}
        pool = proxy.placement.pool(role)
        snapshots = {c.worker_id: c for c in proxy.tracker.candidates(live.values(), loads)}
        free = [wid for wid, c in snapshots.items()
                if not c.recently_failed and _takes(loads.get(wid), wid in joined,
                                                    proxy.tracker.in_flight(wid))]
        if not free:
            return 0
        entries = {e.route.request_id: e for _, es in sources for e in es}
        if role in PREFILL_ROLES:
            tracker = proxy.tracker
            queues = [(wid, max(tracker.pending_tokens(wid)
                                - sum(tracker.tokens_of(wid, e.route.request_id) for e in es), 0),
                       [(e.route, tracker.tokens_of(wid, e.route.request_id)) for e in es])
                      for wid, es in sources]
            tails = {wid: snapshots[wid].pending_prefill_tokens for wid in free}
            moves = pool.plan_redispatch(queues, tails, self.tokens, max_moves=self.max_moves)
        else:
            moves = plan_redispatch(
                [InstanceQueue(wid, loads[wid].running,
                               [QueuedRequest(e.route.request_id, 1, None, 0,
                                              dict.fromkeys(free, 1)) for e in es])
                 for wid, es in sources],
                {wid: snapshots[wid].running for wid in free}, SEQUENCE,
                max_moves=self.max_moves)
        asked = [m for m in moves if self._ask(entries[m.request_id], live[m.target], m)]
        for m in asked:  # a joined worker is a target until a move to it is made
            joined.pop(m.target, None)
        return len(asked)

    def _ask(self, entry: Waiting, target: WorkerRecord, move: Move) -> bool:
        if not entry.move_to(target):
            return False
        logger.debug("re-dispatch asks %s request %s waiting on %s to move to %s (predicted "
                     "TTFT change %.3g)", entry.role, entry.route.request_id, move.source,
                     move.target, move.delta_s)
        return True


    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.step()
            except Exception:  # a bad step must not end re-dispatch for the router's life
                logger.exception("re-dispatch step failed")

    def _joined_now(self, records: Sequence[WorkerRecord]) -> None:
        """A worker joined: plan at once, before new arrivals reach it (they would otherwise
        balance the old queue with requests that came later, a wait the queued ones keep)."""
        moved = self.step()
        logger.info("re-dispatch on the join of %s: %d queued request(s) asked to move",
                    ", ".join(r.worker_id for r in records), moved)

    def start(self) -> None:
        """Run :meth:`step` every ``interval_s`` and whenever a worker joins (0: never)."""
        if self.interval_s > 0 and self._task is None:
            self.proxy.cluster.on_join(self._joined_now)
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stop the loop."""
        await cancel_task(self._task)
        self._task = None


def _takes(load: WorkerLoad | None, joined: bool, in_flight: int) -> bool:
    """Whether a worker is a re-dispatch target (pure): it queues nothing, by its last report,
    and either joined (no report needed: what runs there is this router's ``in_flight``) or
    is idle (reported nothing running, and nothing of this router's in flight there)."""
    if load is None:
        return joined
    return load.waiting == 0 and (joined or (load.running == 0 and in_flight == 0))


def log_move(role: str, request_id: str, source: str, target: str) -> None:
    """The line a re-dispatch that happened leaves in the router's log."""
    logger.info("re-dispatch: %s request %s moved from %s to %s", role, request_id, source,
                target)
