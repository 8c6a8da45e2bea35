"""The discrete-event simulation of one run: N prefill + M decode instances, one policy.

Prefill instances serve a FIFO queue in batches (:class:`~bench.sim.perf.PrefillPerf`); their
true prefix cache is an LRU of block hashes, filled when a batch finishes. The policy sees what
the router would: candidates with in-flight counts and *estimated* uncached tokens pending (the
policy's own cache estimate when it is prefix-aware, else the full prompt). Decode instances
admit up to ``max_running`` sequences (least running first, the rule of
``router.policy.decode_choice``); a request's decode runs ``output_tokens`` steps at the step
time of the batch it joined. TTFT = prefill done + KV transfer + one decode step (+ any wait for
a decode slot). With ``rebalance`` (DualMap only) queued requests of an instance predicted past
the SLO move to their alternate candidate (``router.policy.rebalance``).

Dynamic pools: with a :class:`PoolController` the pools are resized every
``controller.interval_s`` of simulated time. An added instance is billed from the decision on
and serves after ``start_delay_s`` (a worker start); a removed one drains: the policy is told at
once (``Membership``), so it gets no new work, finishes what it holds, then stops, and is billed
until then. Scale-down cancels instances still starting first (they stop at once), then drains
the least loaded serving ones.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from bench.sim.perf import DecodePerf, PrefillPerf
from bench.sim.workload import SimRequest
from router.policy.base import (
    Candidate,
    Dispatched,
    Finished,
    Membership,
    PlacementPolicy,
    PrefixAware,
    RouteRequest,
)
from router.policy.cache_model import PrefixCacheModel
from router.policy.dualmap import DualMapPolicy
from router.policy.load_model import LoadModel
from router.policy.rebalance import QueuedRequest, plan_rebalance

MODEL = "sim"

# instance life cycle
STARTING, READY, DRAINING, STOPPED = 0, 1, 2, 3


class _Job:
    __slots__ = ("req", "route", "est", "alt", "arrival", "cached", "uncached", "worker")

    def __init__(self, req: SimRequest, route: RouteRequest, arrival: float) -> None:
        self.req = req
        self.route = route
        self.arrival = arrival
        self.est = 0
        self.alt: str | None = None
        self.cached = 0
        self.uncached = 0
        self.worker = ""


class _Instance:
    """Billing and life cycle shared by both roles."""

    __slots__ = ("wid", "state", "start_s", "stop_s")

    def __init__(self, wid: str, state: int, start_s: float) -> None:
        self.wid = wid
        self.state = state
        self.start_s = start_s
        self.stop_s: float | None = None

    def billed_s(self, end_s: float) -> float:
        return (end_s if self.stop_s is None else self.stop_s) - self.start_s


class _Prefill(_Instance):
    __slots__ = ("queue", "busy", "batch", "cache", "pending", "in_flight", "busy_s",
                 "batch_est", "batch_start")

    def __init__(self, wid: str, cache_blocks: int, state: int = READY,
                 start_s: float = 0.0) -> None:
        super().__init__(wid, state, start_s)
        self.queue: deque[_Job] = deque()
        self.busy = False
        self.batch: list[_Job] = []
        self.batch_est = 0
        self.batch_start = 0.0
        self.cache = PrefixCacheModel(cache_blocks)
        self.pending = 0  # router's estimate of uncached tokens dispatched, not finished
        self.in_flight = 0
        self.busy_s = 0.0


class _Decode(_Instance):
    __slots__ = ("index", "running", "ctx")

    def __init__(self, index: int, state: int = READY, start_s: float = 0.0) -> None:
        super().__init__(f"d{index:04d}", state, start_s)
        self.index = index
        self.running = 0
        self.ctx = 0


class _LazyIndex(Mapping[str, Candidate]):
    """``worker_id -> Candidate`` built on access, so a 1,000-instance pool costs nothing until
    a policy looks at a member."""

    def __init__(self, inst: dict[str, _Prefill]) -> None:
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

    def __init__(self, inst: dict[str, _Prefill]) -> None:
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


@dataclass(frozen=True)
class IntervalStats:
    """What one control interval saw: the simulator's equivalent of a metrics scrape."""

    now_s: float
    interval_s: float
    arrivals: int
    uncached_tokens: int
    """Prompt tokens prefilled (prefix-cache hits excluded) in the interval."""
    output_tokens: int
    """Output tokens of the requests that started decoding in the interval."""
    ttft_s: tuple[float, ...]
    """TTFT of each request whose first token came in the interval."""
    tpot_s: tuple[float, ...]
    """TPOT of the same requests (those with more than one output token)."""
    prefill_replicas: int
    """Prefill instances serving or starting (what the last decision asked for)."""
    decode_replicas: int
    prefill_ready: int
    decode_ready: int
    prefill_busy: float
    """Busy fraction of the serving prefill instances (0..1, time-weighted)."""
    decode_slots: float
    """Running sequences / ``max_running`` over the serving decode instances (0..1)."""
    uncached_per_request: tuple[int, ...] = ()
    """Uncached prompt tokens of each request prefilled in the interval."""
    prompt_tokens: int = 0
    """Whole prompt tokens (cached ones too) of the requests prefilled in the interval."""


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
    sim_end_s: float = 0.0
    instance_s: dict[str, float] = field(default_factory=dict)
    """Billed instance-seconds per pool (``prefill``, ``decode``)."""
    replicas: list[ReplicaPoint] = field(default_factory=list)
    """Pool sizes over time, one point per change (the first at time 0)."""


def simulate(requests: Iterable[SimRequest], policy: PlacementPolicy, n_prefill: int,
             n_decode: int, prefill: PrefillPerf | None = None,
             decode: DecodePerf | None = None, rate_scale: float = 1.0,
             rebalance_threshold_s: float | None = None, warmup: int = 0,
             controller: PoolController | None = None,
             start_delay_s: float = 30.0) -> RunResult:
    """Replay ``requests`` (arrival times multiplied by ``rate_scale``) through ``policy``.

    Requests with index < ``warmup`` run but are left out of the TTFT/TPOT lists. With a
    ``controller`` the pools start at ``controller.initial()`` and ``n_prefill``/``n_decode``
    are ignored; added instances serve ``start_delay_s`` after the decision.
    """
    pp = prefill or PrefillPerf()
    dp = decode or DecodePerf()
    if controller is not None:
        n_prefill, n_decode = controller.initial()
    if n_prefill < 1 or n_decode < 1:
        raise ValueError("need at least one prefill and one decode instance")
    allp: dict[str, _Prefill] = {}  # every prefill instance ever started (for busy_s)
    inst: dict[str, _Prefill] = {}  # the routable ones
    for _ in range(n_prefill):
        wid = f"p{len(allp):04d}"
        allp[wid] = inst[wid] = _Prefill(wid, pp.cache_blocks)
    pool = _LazyPool(inst)
    policy.observe(Membership(MODEL, tuple(inst)))
    prefix_aware = isinstance(policy, PrefixAware)
    dualmap = policy if isinstance(policy, DualMapPolicy) else None
    load = dualmap.load if dualmap is not None else LoadModel(pp.per_token_s)
    bt = pp.block_tokens
    # decode: heap of (running, index) with lazy invalidation (stale count or not READY)
    dec = [_Decode(i) for i in range(n_decode)]
    d_heap = [(0, i) for i in range(n_decode)]
    d_wait: deque[tuple[float, _Job]] = deque()
    res = RunResult()
    events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload)
    seq = 0
    DONE_P, DONE_D, READY_P, READY_D, TICK = 1, 2, 3, 4, 5
    # interval counters for the controller
    last_tick = 0.0
    n_arr = unc_tok = out_tok = prompt_tok = 0
    iv_ttft: list[float] = []
    iv_tpot: list[float] = []
    iv_unc: list[int] = []
    p_busy = 0.0
    p_area = d_area = run_area = 0.0  # integrals of serving instances and running sequences
    area_t = 0.0

    def counts() -> tuple[int, int, int, int, int, int]:
        ps = [p.state for p in allp.values()]
        ds = [d.state for d in dec]
        return (ps.count(READY), ps.count(READY) + ps.count(STARTING),
                len(ps) - ps.count(STOPPED), ds.count(READY),
                ds.count(READY) + ds.count(STARTING), len(ds) - ds.count(STOPPED))

    def record(now: float) -> None:
        point = ReplicaPoint(now, *counts())
        if res.replicas and res.replicas[-1][1:] == point[1:]:
            return
        if res.replicas and res.replicas[-1].t_s == now:
            res.replicas[-1] = point
        else:
            res.replicas.append(point)

    record(0.0)
    serving_p, serving_d, running_all = n_prefill, n_decode, 0

    def advance(now: float) -> None:
        """Accumulate the time integrals up to ``now`` (only needed with a controller)."""
        nonlocal p_area, d_area, run_area, area_t
        dt = now - area_t
        if dt > 0:
            p_area += serving_p * dt
            d_area += serving_d * dt
            run_area += running_all * dt
            area_t = now

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def stop(x: _Instance, now: float) -> None:
        nonlocal serving_p, serving_d
        if controller is not None:
            advance(now)
        if x.state in (READY, DRAINING):
            if isinstance(x, _Prefill):
                serving_p -= 1
            else:
                serving_d -= 1
        x.state, x.stop_s = STOPPED, now

    def membership_changed() -> None:
        nonlocal pool
        pool = _LazyPool(inst)
        policy.observe(Membership(MODEL, tuple(inst)))

    def start_batch(p: _Prefill, now: float) -> None:
        nonlocal unc_tok, prompt_tok
        batch: list[_Job] = []
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
            iv_unc.append(unc)
            prompt_tok += n
            batch.append(job)
            tokens += unc
            cached_sum += hit
        dur = pp.batch_s(tokens, cached_sum)
        p.busy, p.batch = True, batch
        p.batch_est = sum(j.est for j in batch)
        p.busy_s += dur
        p.batch_start = now
        unc_tok += tokens
        push(now + dur, DONE_P, p)

    def least_running() -> _Decode | None:
        while d_heap:
            running, i = d_heap[0]
            d = dec[i]
            if d.state != READY:
                heapq.heappop(d_heap)
            elif running != d.running:
                heapq.heapreplace(d_heap, (d.running, i))
            else:
                return d if running < dp.max_running else None
        return None

    def admit_decode(job: _Job, ready: float) -> bool:
        """Start ``job``'s decode, or return False when every serving instance is full."""
        nonlocal out_tok, running_all
        d = least_running()
        if d is None:
            return False
        if controller is not None:
            advance(ready)
        ctx = job.req.prompt_tokens
        d.running += 1
        d.ctx += ctx
        running_all += 1
        heapq.heapreplace(d_heap, (d.running, d.index))
        step = dp.step_time_s(d.running, d.ctx)
        ttft = ready + step - job.arrival
        out = job.req.output_tokens
        out_tok += out
        iv_ttft.append(ttft)
        if out > 1:
            iv_tpot.append(step)
        if job.req.index >= warmup:
            res.ttft_s.append(ttft)
            res.req_tpot_s.append(step if out > 1 else 0.0)
            if out > 1:
                res.tpot_s.append(step)
            res.prompt_tokens += job.req.prompt_tokens
            res.cached_tokens += job.cached
        push(ready + step * max(out, 1), DONE_D, (d, ctx))
        return True

    def serve_waiting(now: float) -> None:
        while d_wait:
            ready, job = d_wait[0]
            if not admit_decode(job, max(ready, now)):
                return
            d_wait.popleft()

    def maybe_rebalance(p: _Prefill) -> None:
        assert dualmap is not None and rebalance_threshold_s is not None
        if load.queue_s(p.pending) <= rebalance_threshold_s or len(p.queue) < 2:
            return
        queued = []
        for job in p.queue:
            alt = job.alt if job.alt in inst else None  # never move work onto a draining one
            alt_tokens = 0
            if alt is not None:
                alt_tokens = job.req.prompt_tokens - dualmap.cached_prefix_tokens(job.route, alt)
            queued.append(QueuedRequest(job.route.request_id, job.est, alt, alt_tokens))
        tails = {q.alternate: inst[q.alternate].pending for q in queued if q.alternate}
        moves = plan_rebalance(p.wid, queued, p.batch_est, tails, load, rebalance_threshold_s)
        if not moves:
            return
        by_rid = {j.route.request_id: j for j in p.queue}
        for mv in moves:
            job = by_rid[mv.request_id]
            p.queue.remove(job)
            target = inst[mv.target]
            p.pending -= job.est
            p.in_flight -= 1
            policy.observe(Finished(job.route.request_id, p.wid, MODEL, ok=False))
            job.est = job.req.prompt_tokens - dualmap.cached_prefix_tokens(job.route, target.wid)
            job.alt, job.worker = p.wid, target.wid
            policy.observe(Dispatched(job.route.request_id, target.wid, MODEL, job.route))
            target.pending += job.est
            target.in_flight += 1
            target.queue.append(job)
            res.migrations += 1

    def resize_prefill(want: int, now: float) -> bool:
        live = [p for p in allp.values() if p.state in (STARTING, READY)]
        for _ in range(want - len(live)):
            wid = f"p{len(allp):04d}"
            p = allp[wid] = _Prefill(wid, pp.cache_blocks, STARTING, now)
            push(now + start_delay_s, READY_P, p)
        if want >= len(live):
            return False
        starting = [p for p in reversed(live) if p.state == STARTING]
        ready = sorted((p for p in live if p.state == READY),
                       key=lambda p: (p.pending, p.in_flight, -int(p.wid[1:])))
        changed = False
        for p in (starting + ready)[:len(live) - want]:
            if p.state == STARTING:
                stop(p, now)
                continue
            del inst[p.wid]
            p.state, changed = DRAINING, True
            if not p.busy and not p.queue:
                stop(p, now)
        return changed

    def resize_decode(want: int, now: float) -> None:
        live = [d for d in dec if d.state in (STARTING, READY)]
        for _ in range(want - len(live)):
            d = _Decode(len(dec), STARTING, now)
            dec.append(d)
            push(now + start_delay_s, READY_D, d)
        if want >= len(live):
            return
        starting = [d for d in reversed(live) if d.state == STARTING]
        ready = sorted((d for d in live if d.state == READY),
                       key=lambda d: (d.running, -d.index))
        for d in (starting + ready)[:len(live) - want]:
            if d.state == STARTING:
                stop(d, now)
                continue
            d.state = DRAINING
            if d.running == 0:
                stop(d, now)

    def tick(now: float) -> None:
        nonlocal last_tick, n_arr, unc_tok, out_tok, iv_ttft, iv_tpot, iv_unc, p_busy, prompt_tok
        nonlocal p_area, d_area, run_area
        assert controller is not None
        advance(now)
        for p in allp.values():
            if p.busy:
                p_busy += now - max(p.batch_start, last_tick)
        interval = now - last_tick
        pr, pt, _, dr, dt, _ = counts()
        stats = IntervalStats(
            now, interval, n_arr, unc_tok, out_tok, tuple(iv_ttft), tuple(iv_tpot), pt, dt,
            pr, dr, min(1.0, p_busy / p_area) if p_area > 0 else 0.0,
            min(1.0, run_area / (d_area * dp.max_running)) if d_area > 0 else 0.0, tuple(iv_unc),
            prompt_tok)
        last_tick, n_arr, unc_tok, out_tok, prompt_tok = now, 0, 0, 0, 0
        iv_ttft, iv_tpot, iv_unc, p_busy, p_area, d_area, run_area = [], [], [], 0.0, 0.0, 0.0, 0.0
        want_p, want_d = controller.decide(stats)
        if resize_prefill(max(1, want_p), now):
            membership_changed()
        resize_decode(max(1, want_d), now)
        record(now)

    if controller is not None:
        push(controller.interval_s, TICK, None)
    it = iter(requests)
    nxt = next(it, None)
    now = 0.0
    while nxt is not None or events:
        if nxt is not None and (not events or nxt.arrival_s * rate_scale <= events[0][0]):
            req = nxt
            nxt = next(it, None)
            now = req.arrival_s * rate_scale
            n_arr += 1
            route = RouteRequest(str(req.index), MODEL, block_hashes=req.block_hashes,
                                 num_prompt_tokens=req.prompt_tokens)
            job = _Job(req, route, now)
            if dualmap is not None:
                decision = dualmap.decide(route, pool)
                assert decision is not None
                wid, job.alt = decision.chosen, decision.alternate
            else:
                choice = policy.select(route, pool)
                assert choice is not None
                wid = choice.worker_id
            p = inst[wid]
            job.worker = wid
            job.est = req.prompt_tokens - (
                policy.cached_prefix_tokens(route, wid) if prefix_aware else 0)  # type: ignore[attr-defined]
            policy.observe(Dispatched(route.request_id, wid, MODEL, route))
            p.pending += job.est
            p.in_flight += 1
            p.queue.append(job)
            if rebalance_threshold_s is not None and dualmap is not None:
                maybe_rebalance(p)
            if not p.busy:
                start_batch(p, now)
            continue
        now, _, kind, payload = heapq.heappop(events)
        if kind == DONE_P:
            p = cast(_Prefill, payload)
            if controller is not None:
                p_busy += now - max(p.batch_start, last_tick)
            for job in p.batch:
                p.cache.insert(job.route.block_hashes)
                p.pending -= job.est
                p.in_flight -= 1
                policy.observe(Finished(job.route.request_id, p.wid, MODEL))
                ready = now + dp.kv_transfer_s_per_token * job.req.prompt_tokens
                if d_wait or not admit_decode(job, ready):
                    d_wait.append((ready, job))
            p.busy, p.batch, p.batch_est = False, [], 0
            if p.queue:
                start_batch(p, now)
            elif p.state == DRAINING:
                stop(p, now)
                record(now)
        elif kind == DONE_D:
            d, ctx = cast(tuple[_Decode, int], payload)
            if controller is not None:
                advance(now)
            d.running -= 1
            d.ctx -= ctx
            running_all -= 1
            if d.state == READY:
                heapq.heappush(d_heap, (d.running, d.index))
            elif d.state == DRAINING and d.running == 0:
                stop(d, now)
                record(now)
            serve_waiting(now)
        elif kind == TICK:
            tick(now)
            if nxt is not None:
                push(now + controller.interval_s, TICK, None)  # type: ignore[union-attr]
        elif kind == READY_P:
            p = cast(_Prefill, payload)
            if p.state == STARTING:
                advance(now)
                p.state = READY
                serving_p += 1
                inst[p.wid] = p
                membership_changed()
                record(now)
        else:
            d = cast(_Decode, payload)
            if d.state == STARTING:
                advance(now)
                d.state = READY
                serving_d += 1
                heapq.heappush(d_heap, (0, d.index))
                record(now)
                serve_waiting(now)
    res.busy_s = {w: p.busy_s for w, p in allp.items()}
    res.sim_end_s = now
    res.instance_s = {"prefill": sum(p.billed_s(now) for p in allp.values()),
                      "decode": sum(d.billed_s(now) for d in dec)}
    return res
