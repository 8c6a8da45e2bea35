"""The discrete-event simulation of one run: N prefill + M decode instances, one placement.

Placement is the router's own object (:class:`router.placement.Placement`): its prefill pool
chooses and books every prefill, its decode pool every decode, with the same ``choose`` /
``begin`` / ``end`` / ``sync`` calls the router's proxy makes. The policies see what the router
would: candidates with in-flight counts and *estimated* uncached tokens pending (the policy's
own cache estimate when it is prefix-aware, else the full prompt).

Prefill instances serve a FIFO queue in batches (:class:`~bench.sim.perf.PrefillPerf`); their
true prefix cache is an LRU of block hashes, filled when a batch finishes. Decode instances are
chosen by the decode policy, by default the router's ``kv_aware`` with ``max_running`` from
:class:`~bench.sim.perf.DecodePerf` and ``strict`` (when every instance is full the request waits
for a slot); a request's decode runs ``output_tokens`` steps at the step time of the batch it
joined. TTFT = prefill done + KV transfer + one decode step (+ any wait for a decode slot). With
``rebalance_threshold_s``, queued requests of an instance predicted past it move to the
alternate candidate placement named for them (``router.policy.rebalance``; only policies that
name one, i.e. DualMap, ever move anything).

Dynamic pools: with a :class:`PoolController` the pools are resized every
``controller.interval_s`` of simulated time. An added instance is billed from the decision on
and serves after ``start_delay_s`` (a worker start); a removed one drains: placement is told at
once (``Membership``), so it gets no new work, finishes what it holds, then stops, and is billed
until then. Scale-down cancels instances still starting first (they stop at once), then drains
the least loaded serving ones.

Moving queued work (:class:`Moves`, off unless given): a prefill request that waits in an
instance's queue (not in its running batch) may be re-dispatched through the placement object
(``Pool.plan_redispatch`` then ``Pool.move``, :func:`router.policy.rebalance.plan_redispatch`):
when a prefill instance becomes ready (``on_join``: to it, from every queue, when the move
lowers the total predicted TTFT), every interval (``on_tick``: to the idle instances), and when
one is removed (``evacuate``: its whole queue goes to the serving instances, so it stops after
its running batch). Decode needs none of this: a request waiting for a decode slot waits in one
queue for the whole pool and starts on whichever instance frees a slot or joins first. A new
prefill instance's prefix cache starts empty; with ``warm_blocks`` it first pulls the prefixes
of recent requests placement would now send it, each from the instance holding most of it, at
the KV transfer cost, so it serves that much later (survivors pull a removed instance's the same
way, in the background; the policy is told through ``CacheChanged``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from bench.sim.meter import IntervalMeter, IntervalStats
from bench.sim.pools import (
    DRAINING,
    READY,
    STARTING,
    STOPPED,
    DecodeInstance,
    DecodePool,
    Instance,
    Job,
    PrefillInstance,
    PrefillPool,
)
from bench.sim.workload import SimRequest
from router.autoscale.profile import DecodePerf, PrefillPerf
from router.placement import Placement, Pool
from router.policy.base import CacheChanged, PlacementPolicy, PolicyEvent, RouteRequest
from router.policy.load_model import LoadModel
from router.policy.rebalance import QueuedRequest, plan_rebalance
from router.policy.registry import create_decode_policy
from router.policy.warm import plan_warm

__all__ = ["IntervalStats", "Moves", "PoolController", "ReplicaPoint", "RunResult", "simulate",
           "sim_placement"]

MODEL = "sim"
# event kinds
DONE_P, DONE_D, READY_P, READY_D, TICK = 1, 2, 3, 4, 5


class PoolController(Protocol):
    """Sizes the pools during a run (:mod:`bench.sim.autoscale` has the planner, threshold and
    scripted ones).

    The simulator calls ``initial`` once before the first arrival (those instances are ready at
    time 0), then ``decide`` every ``interval_s`` of simulated time while arrivals remain, and
    applies the returned ``(prefill, decode)`` counts of serving + starting instances.
    """

    interval_s: float

    def initial(self) -> tuple[int, int]: ...

    def decide(self, stats: IntervalStats) -> tuple[int, int]: ...


@dataclass(frozen=True)
class Moves:
    """When the simulator moves queued prefill requests between instances (module doc)."""

    on_join: bool = True
    """Re-dispatch waiting requests to a prefill instance that just became ready."""
    on_tick: bool = False
    """Every controller interval, re-dispatch waiting requests to idle prefill instances."""
    evacuate: bool = True
    """A removed prefill instance hands its waiting requests to the serving ones."""
    max_moves: int = 256
    """Most moves per join or tick (an evacuation moves its whole queue)."""
    warm_blocks: int = 0
    """Most prefix blocks an instance pulls to warm its cache: a joining one (before it
    serves) and each that takes over a removed one's requests (in the background)."""
    recent_requests: int = 2000
    """Recent prefill requests whose prefixes count as the pool's hot ones."""

    def __post_init__(self) -> None:
        if self.max_moves < 0 or self.warm_blocks < 0 or self.recent_requests < 0:
            raise ValueError("need max_moves, warm_blocks and recent_requests >= 0")


class ReplicaPoint(NamedTuple):
    """Pool sizes from ``t_s`` on: ready (serving), target (ready + starting), and billed
    (starting + ready + draining)."""

    t_s: float
    prefill_ready: int
    prefill_target: int
    prefill_billed: int
    decode_ready: int
    decode_target: int
    decode_billed: int


@dataclass
class RunResult:
    """Per-request outcomes and per-instance totals of one run."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    req_tpot_s: list[float] = field(default_factory=list)
    """TPOT of each request of ``ttft_s``, in the same order (0.0 for one output token)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    migrations: int = 0
    """Hotspot rebalancing moves (DualMap's alternates)."""
    redispatched: dict[str, int] = field(default_factory=lambda: {"join": 0, "tick": 0,
                                                                  "evacuate": 0})
    """Waiting prefill requests moved by :class:`Moves`, per occasion."""
    sim_end_s: float = 0.0
    instance_s: dict[str, float] = field(default_factory=dict)
    """Billed instance-seconds per pool (``prefill``, ``decode``)."""
    replicas: list[ReplicaPoint] = field(default_factory=list)
    """Pool sizes over time, one point per change (the first at time 0)."""


def sim_placement(policy: PlacementPolicy, decode_policy: PlacementPolicy,
                  prefill: PrefillPool, decode: DecodePool,
                  observer: Callable[[str, PolicyEvent], None] | None = None) -> Placement:
    """The router's placement object over simulated pools: ``policy`` places prefills,
    ``decode_policy`` decodes; each pool is its own ledger. ``observer(role, event)`` hears
    every event placement sends a policy."""
    def tap(role: str) -> tuple[Callable[[PolicyEvent], None], ...]:
        return () if observer is None else (lambda event: observer(role, event),)

    return Placement({"prefill": Pool("prefill", policy, prefill, tap("prefill")),
                      "decode": Pool("decode", decode_policy, decode, tap("decode"))})


class _Run:
    """One simulation: the pools, the placement driving them, the event queue, the meter."""

    def __init__(self, policy: PlacementPolicy, decode_policy: PlacementPolicy | None,
                 n_prefill: int, n_decode: int, pp: PrefillPerf, dp: DecodePerf,
                 rebalance_threshold_s: float | None, warmup: int,
                 controller: PoolController | None, start_delay_s: float,
                 observer: Callable[[str, PolicyEvent], None] | None,
                 moves: Moves | None) -> None:
        self.pp, self.dp = pp, dp
        self.moves = moves
        self.threshold = rebalance_threshold_s
        self.warmup = warmup
        self.controller = controller
        self.metered = controller is not None
        self.start_delay_s = start_delay_s
        self.prefill = PrefillPool(pp.cache_blocks)
        for _ in range(n_prefill):
            self.prefill.add()
        self.prefill.refresh()
        self.decode = DecodePool(n_decode)
        if decode_policy is None:
            decode_policy = create_decode_policy("kv_aware", max_running=dp.max_running,
                                                 strict=True)
        self.placement = sim_placement(policy, decode_policy, self.prefill, self.decode,
                                       observer)
        self.p_place = self.placement.pool("prefill")
        self.d_place = self.placement.pool("decode")
        self.p_place.sync(MODEL, self.prefill.routable)
        self.d_place.sync(MODEL, self.decode.ready_ids())
        self.load = LoadModel(pp.per_token_s)
        self.d_wait: deque[tuple[float, Job]] = deque()
        self.drained: list[PrefillInstance] = []  # removed this tick, work still queued
        self.removed: list[PrefillInstance] = []  # removed this tick
        self.recent: deque[RouteRequest] = deque(maxlen=moves.recent_requests if moves else 0)
        self.res = RunResult()
        self.events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload)
        self.seq = 0
        self.meter = IntervalMeter(n_prefill, n_decode)
        self.record(0.0)

    # -- bookkeeping -------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def counts(self) -> tuple[int, int, int, int, int, int]:
        ps = [p.state for p in self.prefill.all.values()]
        ds = [d.state for d in self.decode.instances]
        return (ps.count(READY), ps.count(READY) + ps.count(STARTING),
                len(ps) - ps.count(STOPPED), ds.count(READY),
                ds.count(READY) + ds.count(STARTING), len(ds) - ds.count(STOPPED))

    def record(self, now: float) -> None:
        replicas = self.res.replicas
        point = ReplicaPoint(now, *self.counts())
        if replicas and replicas[-1][1:] == point[1:]:
            return
        if replicas and replicas[-1].t_s == now:
            replicas[-1] = point
        else:
            replicas.append(point)

    def stop(self, x: Instance, now: float) -> None:
        if self.metered:
            self.meter.advance(now)
        if x.state in (READY, DRAINING):
            if isinstance(x, PrefillInstance):
                self.meter.serving_p -= 1
            else:
                self.meter.serving_d -= 1
        x.state, x.stop_s = STOPPED, now

    def prefill_members_changed(self) -> None:
        self.prefill.refresh()
        self.p_place.sync(MODEL, self.prefill.routable)

    # -- prefill -----------------------------------------------------------------------------

    def arrive(self, req: SimRequest, now: float) -> None:
        """Place a new request on a prefill instance (and maybe rebalance that one)."""
        self.meter.arrivals += 1
        route = RouteRequest(str(req.index), MODEL, block_hashes=req.block_hashes,
                             num_prompt_tokens=req.prompt_tokens)
        job = Job(req, route, now)
        self.recent.append(route)
        choice = self.p_place.choose(route, self.prefill.candidates)
        assert choice is not None
        p = self.prefill.routable[choice.worker]
        job.worker, job.alt = choice.worker, choice.alternate
        job.est = self.p_place.begin(route, choice.worker)
        p.queue.append(job)
        if self.threshold is not None and choice.alternate is not None:
            self.maybe_rebalance(p)
        if not p.busy:
            self.start_batch(p, now)

    def start_batch(self, p: PrefillInstance, now: float) -> None:
        pp, m = self.pp, self.meter
        bt = pp.block_tokens
        batch: list[Job] = []
        tokens = 0
        cached_sum = 0
        while p.queue:
            job = p.queue[0]
            n = job.req.prompt_tokens
            hit = min(p.cache.match(job.route.block_hashes) * bt, n - 1) if n else 0
            unc = n - hit
            if batch and tokens + unc > pp.max_batch_tokens:
                break
            p.queue.popleft()
            job.cached, job.uncached = hit, unc
            m.unc.append(unc)
            m.prompt += n
            batch.append(job)
            tokens += unc
            cached_sum += hit
        dur = pp.batch_s(tokens, cached_sum)
        p.busy, p.batch = True, batch
        p.batch_est = sum(j.est for j in batch)
        p.busy_s += dur
        p.batch_start = now
        m.uncached += tokens
        self.push(now + dur, DONE_P, p)

    def prefill_done(self, p: PrefillInstance, now: float) -> None:
        if self.metered:
            self.meter.p_busy += now - max(p.batch_start, self.meter.last_tick)
        kv_s = self.dp.kv_transfer_s_per_token
        for job in p.batch:
            p.cache.insert(job.route.block_hashes)
            self.p_place.end(job.route, p.wid)
            ready = now + kv_s * job.req.prompt_tokens
            if self.d_wait or not self.admit_decode(job, ready):
                self.d_wait.append((ready, job))
        p.busy, p.batch, p.batch_est = False, [], 0
        if p.queue:
            self.start_batch(p, now)
        elif p.state == DRAINING:
            self.stop(p, now)
            self.record(now)

    def maybe_rebalance(self, p: PrefillInstance) -> None:
        """Move queued requests of ``p`` to their alternates when ``p`` is a hotspot."""
        threshold, load = cast(float, self.threshold), self.load
        if load.queue_s(p.pending) <= threshold or len(p.queue) < 2:
            return
        routable, place = self.prefill.routable, self.p_place
        queued = []
        for job in p.queue:
            alt = job.alt if job.alt in routable else None  # never move onto a draining one
            alt_tokens = 0
            if alt is not None:
                alt_tokens = job.req.prompt_tokens - place.cached_tokens(job.route, alt)
            queued.append(QueuedRequest(job.route.request_id, job.est, alt, alt_tokens))
        tails = {q.alternate: routable[q.alternate].pending for q in queued if q.alternate}
        moves = plan_rebalance(p.wid, queued, p.batch_est, tails, load, threshold)
        if not moves:
            return
        by_rid = {j.route.request_id: j for j in p.queue}
        for mv in moves:
            job = by_rid[mv.request_id]
            p.queue.remove(job)
            target = routable[mv.target]
            place.end(job.route, p.wid, ok=False)
            job.est = place.begin(job.route, target.wid)
            job.alt, job.worker = p.wid, target.wid
            target.queue.append(job)
            self.res.migrations += 1

    # -- decode ------------------------------------------------------------------------------

    def admit_decode(self, job: Job, ready: float) -> bool:
        """Start ``job``'s decode, or return False when the decode policy finds no room."""
        choice = self.d_place.choose(job.route, self.decode.candidates)
        if choice is None:
            return False
        d = self.decode.of(choice.worker)
        m, res = self.meter, self.res
        if self.metered:
            m.advance(ready)
        ctx = job.req.prompt_tokens
        self.d_place.begin(job.route, d.wid)
        d.ctx += ctx
        m.running += 1
        step = self.dp.step_time_s(d.running, d.ctx)
        ttft = ready + step - job.arrival
        out = job.req.output_tokens
        m.output += out
        m.ttft.append(ttft)
        if out > 1:
            m.tpot.append(step)
        if job.req.index >= self.warmup:
            res.ttft_s.append(ttft)
            res.req_tpot_s.append(step if out > 1 else 0.0)
            if out > 1:
                res.tpot_s.append(step)
            res.prompt_tokens += job.req.prompt_tokens
            res.cached_tokens += job.cached
        self.push(ready + step * max(out, 1), DONE_D, (d, ctx, job))
        return True

    def serve_waiting(self, now: float) -> None:
        wait = self.d_wait
        while wait:
            ready, job = wait[0]
            if not self.admit_decode(job, max(ready, now)):
                return
            wait.popleft()

    def decode_done(self, d: DecodeInstance, ctx: int, job: Job, now: float) -> None:
        if self.metered:
            self.meter.advance(now)
        self.d_place.end(job.route, d.wid)
        d.ctx -= ctx
        self.meter.running -= 1
        if d.state == DRAINING and d.running == 0:
            self.stop(d, now)
            self.record(now)
        self.serve_waiting(now)

    # -- pool sizes --------------------------------------------------------------------------

    def resize_prefill(self, want: int, now: float) -> bool:
        pool = self.prefill
        live = [p for p in pool.all.values() if p.state in (STARTING, READY)]
        for _ in range(want - len(live)):
            self.push(now + self.start_delay_s, READY_P, pool.add(STARTING, now))
        if want >= len(live):
            return False
        starting = [p for p in reversed(live) if p.state == STARTING]
        ready = sorted((p for p in live if p.state == READY),
                       key=lambda p: (p.pending, p.in_flight, -int(p.wid[1:])))
        changed = False
        for p in (starting + ready)[:len(live) - want]:
            if p.state == STARTING:
                self.stop(p, now)
                continue
            del pool.routable[p.wid]
            p.state, changed = DRAINING, True
            self.removed.append(p)
            if not p.busy and not p.queue:
                self.stop(p, now)
            else:
                self.drained.append(p)
        return changed

    def resize_decode(self, want: int, now: float) -> bool:
        pool = self.decode
        live = [d for d in pool.instances if d.state in (STARTING, READY)]
        for _ in range(want - len(live)):
            self.push(now + self.start_delay_s, READY_D, pool.add(STARTING, now))
        if want >= len(live):
            return False
        starting = [d for d in reversed(live) if d.state == STARTING]
        ready = sorted((d for d in live if d.state == READY), key=lambda d: (d.running, -d.index))
        changed = False
        for d in (starting + ready)[:len(live) - want]:
            if d.state == STARTING:
                self.stop(d, now)
                continue
            d.state, changed = DRAINING, True
            if d.running == 0:
                self.stop(d, now)
        return changed

    def tick(self, now: float) -> None:
        controller, m = cast(PoolController, self.controller), self.meter
        m.advance(now)
        for p in self.prefill.all.values():
            if p.busy:
                m.p_busy += now - max(p.batch_start, m.last_tick)
        want_p, want_d = controller.decide(m.snapshot(now, self.counts(), self.dp.max_running))
        self.drained, self.removed = [], []
        if self.resize_prefill(max(1, want_p), now):
            self.prefill_members_changed()
        mv = self.moves
        if mv is not None and mv.warm_blocks and self.removed:
            self.hand_over(lambda wid: True, self.removed)
        if mv is not None and mv.evacuate and self.drained:
            routable = self.prefill.routable.values()
            self.redispatch(now, "evacuate", list(routable), self.drained)
            for p in self.drained:
                if not p.busy and not p.queue:
                    self.stop(p, now)
        if mv is not None and mv.on_tick:
            idle = [p for p in self.prefill.routable.values() if not p.busy and not p.queue]
            if idle:
                self.redispatch(now, "tick", idle)
        if self.resize_decode(max(1, want_d), now):
            self.d_place.sync(MODEL, self.decode.ready_ids())
        self.record(now)

    def ready_prefill(self, p: PrefillInstance, now: float) -> None:
        if p.state != STARTING:
            return
        mv = self.moves
        self.meter.advance(now)
        p.state = READY
        self.meter.serving_p += 1
        self.prefill.routable[p.wid] = p
        self.prefill_members_changed()
        self.record(now)
        if mv is not None and mv.warm_blocks:
            pull_s = self.hand_over(lambda wid: wid == p.wid)
            if pull_s > 0:  # busy pulling: what placement sends meanwhile queues
                p.busy, p.batch_start = True, now
                self.push(now + pull_s, DONE_P, p)
        if mv is not None and mv.on_join:
            self.redispatch(now, "join", [p])

    def hand_over(self, takes: Callable[[str], bool],
                  holders: Iterable[PrefillInstance] | None = None) -> float:
        """Warm the instances ``takes`` accepts with the prefixes of recent requests placement
        would send them, as the router plans it (:func:`router.policy.warm.plan_warm`), pulled
        from the instance that holds the most of each (from ``holders`` only, when given): at
        most ``warm_blocks`` blocks each, newest requests first. A request counts for where
        placement sends it, or for its spill target (placement's choice with that first
        choice taken out), as the router asks. The policy hears what
        each now caches (``CacheChanged``). Returns the longest pull (blocks x block tokens x
        the KV transfer time per token) any of them makes."""
        budget = cast(Moves, self.moves).warm_blocks
        pool, place = self.prefill, self.p_place
        sources = list(pool.routable.values() if holders is None else holders)

        def choose(route: RouteRequest) -> str | None:
            choice = place.choose(route, pool.candidates)
            if choice is not None and not takes(choice.worker):  # its spill target
                choice = place.choose(route, [c for c in pool.candidates
                                              if c.worker_id != choice.worker])
            return None if choice is None else choice.worker

        def held(route: RouteRequest, wid: str) -> int:
            return max((x.cache.match(route.block_hashes) for x in sources if x.wid != wid),
                       default=0)

        plans = plan_warm(list(self.recent), choose, takes,
                          lambda route, wid: pool.routable[wid].cache.match(route.block_hashes),
                          held, lambda route: route.block_hashes, budget)
        longest = 0
        for wid, wanted in plans.items():
            cache = pool.routable[wid].cache
            for prefix in reversed(wanted):  # oldest first: the newest end most recent
                chain = tuple(prefix.route.block_hashes[:prefix.blocks])
                cache.insert(chain)
                place.tell(CacheChanged(wid, stored=chain))
            longest = max(longest, sum(p.new_blocks for p in wanted))
        return longest * self.pp.block_tokens * self.dp.kv_transfer_s_per_token

    def redispatch(self, now: float, why: str, targets: list[PrefillInstance],
                   evacuate: list[PrefillInstance] | None = None) -> None:
        """Move waiting prefill requests to ``targets`` (or off ``evacuate``) as placement's
        re-dispatch rule plans; start the targets that got work."""
        mv = cast(Moves, self.moves)
        pool = self.prefill
        if evacuate is not None:
            src_insts = evacuate
            limit = sum(len(p.queue) for p in evacuate)
        else:
            src_insts = [x for x in pool.all.values()
                         if x.queue and x.state in (READY, DRAINING) and x not in targets]
            limit = mv.max_moves
        if not src_insts or not targets or not limit:
            return
        sources = [(x.wid, x.batch_est, [(j.route, j.est) for j in x.queue]) for x in src_insts]
        tails = {t.wid: t.pending for t in targets}
        place = self.p_place
        moves = place.plan_redispatch(sources, tails, self.load,
                                      [x.wid for x in evacuate or ()], limit)
        if not moves:
            return
        touched: dict[str, PrefillInstance] = {}
        for m in moves:
            src, dst = pool.all[m.source], pool.all[m.target]
            job = next(j for j in src.queue if j.route.request_id == m.request_id)
            src.queue.remove(job)
            job.est = place.move(job.route, src.wid, dst.wid)
            job.worker = dst.wid
            if job.alt == dst.wid:
                job.alt = src.wid if src.wid in pool.routable else None
            dst.queue.append(job)
            touched[dst.wid] = dst
        self.res.redispatched[why] += len(moves)
        for dst in touched.values():
            if not dst.busy:
                self.start_batch(dst, now)

    def ready_decode(self, d: DecodeInstance, now: float) -> None:
        if d.state == STARTING:
            self.meter.advance(now)
            d.state = READY
            self.meter.serving_d += 1
            self.decode.ready(d)
            self.d_place.sync(MODEL, self.decode.ready_ids())
            self.record(now)
            self.serve_waiting(now)

    # -- the event loop ----------------------------------------------------------------------

    def run(self, requests: Iterable[SimRequest], rate_scale: float) -> RunResult:
        events = self.events
        interval_s = self.controller.interval_s if self.controller is not None else 0.0
        if self.controller is not None:
            self.push(interval_s, TICK, None)
        it = iter(requests)
        nxt = next(it, None)
        now = 0.0
        while nxt is not None or events:
            if nxt is not None and (not events or nxt.arrival_s * rate_scale <= events[0][0]):
                req, nxt = nxt, next(it, None)
                now = req.arrival_s * rate_scale
                self.arrive(req, now)
                continue
            now, _, kind, payload = heapq.heappop(events)
            if kind == DONE_P:
                self.prefill_done(cast(PrefillInstance, payload), now)
            elif kind == DONE_D:
                d, ctx, job = cast(tuple[DecodeInstance, int, Job], payload)
                self.decode_done(d, ctx, job, now)
            elif kind == TICK:
                self.tick(now)
                if nxt is not None:
                    self.push(now + interval_s, TICK, None)
            elif kind == READY_P:
                self.ready_prefill(cast(PrefillInstance, payload), now)
            else:
                self.ready_decode(cast(DecodeInstance, payload), now)
        res = self.res
        res.busy_s = {w: p.busy_s for w, p in self.prefill.all.items()}
        res.sim_end_s = now
        res.instance_s = {"prefill": sum(p.billed_s(now) for p in self.prefill.all.values()),
                          "decode": sum(d.billed_s(now) for d in self.decode.instances)}
        return res


def simulate(requests: Iterable[SimRequest], policy: PlacementPolicy, n_prefill: int,
             n_decode: int, prefill: PrefillPerf | None = None,
             decode: DecodePerf | None = None, rate_scale: float = 1.0,
             rebalance_threshold_s: float | None = None, warmup: int = 0,
             controller: PoolController | None = None,
             start_delay_s: float = 30.0, decode_policy: PlacementPolicy | None = None,
             observer: Callable[[str, PolicyEvent], None] | None = None,
             moves: Moves | None = None) -> RunResult:
    """Replay ``requests`` (arrival times multiplied by ``rate_scale``), placing prefills with
    ``policy`` and decodes with ``decode_policy`` (default: ``kv_aware`` at the decode
    instances' ``max_running``, strict) through one :class:`router.placement.Placement`.

    Requests with index < ``warmup`` run but are left out of the TTFT/TPOT lists. With a
    ``controller`` the pools start at ``controller.initial()`` and ``n_prefill``/``n_decode``
    are ignored; added instances serve ``start_delay_s`` after the decision.
    ``observer(role, event)`` hears
    every placement event (membership, dispatch, finish) of both pools, in order.
    ``moves`` turns on re-dispatch of waiting prefill requests (:class:`Moves`; None: off).
    """
    pp = prefill or PrefillPerf()
    dp = decode or DecodePerf()
    if controller is not None:
        n_prefill, n_decode = controller.initial()
    if n_prefill < 1 or n_decode < 1:
        raise ValueError("need at least one prefill and one decode instance")
    run = _Run(policy, decode_policy, n_prefill, n_decode, pp, dp, rebalance_threshold_s,
               warmup, controller, start_delay_s, observer, moves)
    return run.run(requests, rate_scale)
