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
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

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


class _Prefill:
    __slots__ = ("wid", "queue", "busy", "batch", "cache", "pending", "in_flight", "busy_s",
                 "batch_est")

    def __init__(self, wid: str, cache_blocks: int) -> None:
        self.wid = wid
        self.queue: deque[_Job] = deque()
        self.busy = False
        self.batch: list[_Job] = []
        self.batch_est = 0
        self.cache = PrefixCacheModel(cache_blocks)
        self.pending = 0  # router's estimate of uncached tokens dispatched, not finished
        self.in_flight = 0
        self.busy_s = 0.0


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


@dataclass
class RunResult:
    """Per-request outcomes and per-instance totals of one run."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    migrations: int = 0
    sim_end_s: float = 0.0


def simulate(requests: Iterable[SimRequest], policy: PlacementPolicy, n_prefill: int,
             n_decode: int, prefill: PrefillPerf | None = None,
             decode: DecodePerf | None = None, rate_scale: float = 1.0,
             rebalance_threshold_s: float | None = None, warmup: int = 0) -> RunResult:
    """Replay ``requests`` (arrival times multiplied by ``rate_scale``) through ``policy``.

    Requests with index < ``warmup`` run but are left out of the TTFT/TPOT lists.
    """
    pp = prefill or PrefillPerf()
    dp = decode or DecodePerf()
    inst = {f"p{i:04d}": _Prefill(f"p{i:04d}", pp.cache_blocks) for i in range(n_prefill)}
    pool = _LazyPool(inst)
    policy.observe(Membership(MODEL, tuple(inst)))
    prefix_aware = isinstance(policy, PrefixAware)
    dualmap = policy if isinstance(policy, DualMapPolicy) else None
    load = dualmap.load if dualmap is not None else LoadModel(pp.per_token_s)
    bt = pp.block_tokens
    # decode: running count per instance; heap of (running, id) with lazy invalidation
    d_running = [0] * n_decode
    d_ctx = [0] * n_decode
    d_heap = [(0, i) for i in range(n_decode)]
    d_wait: deque[tuple[float, _Job]] = deque()
    res = RunResult()
    events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload)
    seq = 0
    DONE_P, DONE_D = 1, 2

    def start_batch(p: _Prefill, now: float) -> None:
        nonlocal seq
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
            batch.append(job)
            tokens += unc
            cached_sum += hit
        dur = pp.batch_s(tokens, cached_sum)
        p.busy, p.batch = True, batch
        p.batch_est = sum(j.est for j in batch)
        p.busy_s += dur
        seq += 1
        heapq.heappush(events, (now + dur, seq, DONE_P, p))

    def admit_decode(job: _Job, ready: float) -> None:
        nonlocal seq
        while True:
            running, i = d_heap[0]
            if running == d_running[i]:
                break
            heapq.heapreplace(d_heap, (d_running[i], i))
        if running >= dp.max_running:
            d_wait.append((ready, job))
            return
        ctx = job.req.prompt_tokens
        d_running[i] += 1
        d_ctx[i] += ctx
        heapq.heapreplace(d_heap, (d_running[i], i))
        step = dp.step_time_s(d_running[i], d_ctx[i])
        ttft = ready + step - job.arrival
        out = job.req.output_tokens
        if job.req.index >= warmup:
            res.ttft_s.append(ttft)
            if out > 1:
                res.tpot_s.append(step)
            res.prompt_tokens += job.req.prompt_tokens
            res.cached_tokens += job.cached
        seq += 1
        heapq.heappush(events, (ready + step * max(out, 1), seq, DONE_D, (i, ctx)))

    def maybe_rebalance(p: _Prefill) -> None:
        assert dualmap is not None and rebalance_threshold_s is not None
        if load.queue_s(p.pending) <= rebalance_threshold_s or len(p.queue) < 2:
            return
        queued = []
        for job in p.queue:
            alt = job.alt
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

    it = iter(requests)
    nxt = next(it, None)
    now = 0.0
    while nxt is not None or events:
        if nxt is not None and (not events or nxt.arrival_s * rate_scale <= events[0][0]):
            req = nxt
            nxt = next(it, None)
            now = req.arrival_s * rate_scale
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
            assert isinstance(payload, _Prefill)
            p = payload
            for job in p.batch:
                p.cache.insert(job.route.block_hashes)
                p.pending -= job.est
                p.in_flight -= 1
                policy.observe(Finished(job.route.request_id, p.wid, MODEL))
                admit_decode(job, now + dp.kv_transfer_s_per_token * job.req.prompt_tokens)
            p.busy, p.batch, p.batch_est = False, [], 0
            if p.queue:
                start_batch(p, now)
        else:
            i, ctx = cast(tuple[int, int], payload)
            d_running[i] -= 1
            d_ctx[i] -= ctx
            heapq.heappush(d_heap, (d_running[i], i))
            if d_wait:
                ready, job = d_wait.popleft()
                admit_decode(job, max(ready, now))
    res.busy_s = {w: p.busy_s for w, p in inst.items()}
    res.sim_end_s = now
    return res
