"""A fleet of colocated engines whose every request's path is planned by the router's
:class:`router.policy.adaptive.AdaptivePaths`.

Fleets (:func:`make_fleet`, N engines):

- ``adaptive``: N ``flex`` engines; each request whole or P/D, sent now or held, as the policy
  decides (the router's default, ``--hold-prefills``);
- ``adaptive_nohold``: the same without held plans (``--no-hold-prefills``: the split rule);
- ``aggregated``: N ``aggregated`` engines; every request whole (the policy picks the engine);
- ``pd1:3`` ... ``pd3:1``: static P/D, ``prefill`` : ``decode`` engines in that ratio (at least
  one of each); every request forced onto a P/D path (``force="pd"``), so the policy only picks
  the pair.

A held plan is held as the router holds it: sent when the requests it waits for have finished,
or at its limit (``router.policy.adaptive.hold_limit_s``).

The simulator calls the policy exactly as a router would, with simulated time: per arrival
``loads(request, [(role, Candidate)], now)`` then ``decide(request, output_tokens, loads,
force)`` then ``dispatched(request, plan, output_tokens, now)``; ``finished(request_id)`` when
the last token is out. Candidates carry the engines' true running sequences and in-flight
requests (what the router scrapes and counts). ``output_tokens`` is the request's length (the
benchmark clients send ``max_tokens`` = the length with ``ignore_eos``).

Timing (:mod:`bench.sim.colocated` runs the engines): a whole request's first token comes with
the iteration that finishes its prefill, then it joins that engine's batch. A P/D request's
first token is out ``hop_s`` after its prefill (the cost model's TTFT), its KV lands on the
decode engine ``prompt x pull_s_per_token`` later, and it decodes the rest there. TPOT =
(last token - first token) / (output - 1).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from bench.sim.colocated import ColocatedEngine
from bench.sim.workload import SimRequest
from router.policy.adaptive import AdaptivePaths, hold_limit_s
from router.policy.base import Candidate, RouteRequest
from router.policy.path_cost import PathCosts, PlanEstimate

MODEL = "sim"
PD_RATIOS: tuple[tuple[int, int], ...] = ((1, 3), (1, 2), (1, 1), (2, 1), (3, 1))
FLEETS: tuple[str, ...] = ("adaptive", "adaptive_nohold", "aggregated",
                           *(f"pd{p}:{d}" for p, d in PD_RATIOS))
"""Every fleet name :func:`make_fleet` knows, adaptive first."""


@dataclass(frozen=True)
class Fleet:
    """The roles of a fleet's engines and the path it forces (None: the policy chooses)."""

    name: str
    roles: tuple[str, ...]
    force: str | None = None
    defer: bool = False
    """The policy may hold requests (``AdaptivePaths.defer``)."""


def make_fleet(name: str, n: int) -> Fleet:
    """The fleet ``name`` (one of :data:`FLEETS`) of ``n`` engines; ValueError otherwise."""
    if n < 2:
        raise ValueError(f"a fleet needs >= 2 engines, got {n}")
    if name == "adaptive":
        return Fleet(name, ("flex",) * n, defer=True)
    if name == "adaptive_nohold":
        return Fleet(name, ("flex",) * n)
    if name == "aggregated":
        return Fleet(name, ("aggregated",) * n)
    if name in FLEETS:
        p, d = (int(x) for x in name[2:].split(":"))
        n_p = min(max(round(n * p / (p + d)), 1), n - 1)
        return Fleet(name, ("prefill",) * n_p + ("decode",) * (n - n_p), force="pd")
    raise ValueError(f"unknown fleet {name!r}; allowed: {', '.join(FLEETS)}")


@dataclass(frozen=True)
class FleetSettings:
    """What one fleet run holds fixed."""

    ttft_slo_s: float
    tpot_slo_s: float
    costs: PathCosts = field(default_factory=PathCosts)
    """The engines' true costs, and the policy's (a calibrated router)."""
    chunk_tokens: int = 2048
    """Most prefill tokens one iteration carries (vLLM's ``max_num_batched_tokens``)."""
    cache_blocks: int = 20_000
    """Prefix-cache size per engine, in blocks."""
    block_tokens: int = 16
    engine_block_tokens: int | None = None
    """The engine reuses cached prefixes in whole blocks of this many tokens (vLLM's block
    size: 128 on CPU); None: to the token, as the policy's ``block_tokens`` model it."""
    warmup_s: float = 10.0
    """Requests arriving earlier run but are not measured."""


def within_slos(ttft_s: float, tpot_s: float, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Whether one request met both SLOs."""
    return ttft_s <= ttft_slo_s and tpot_s <= tpot_slo_s


@dataclass
class FleetResult:
    """Per-request outcomes of the measured requests and the paths taken."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    """TPOT of each request of ``ttft_s`` in the same order (0.0 for one output token)."""
    paths: Counter[str] = field(default_factory=Counter)
    """``whole`` / ``pd`` count of every request."""
    reasons: Counter[str] = field(default_factory=Counter)
    prefill_share: float = 0.0
    """Prefill seconds / busy seconds over all engines."""
    stopped_s: float | None = None
    """Simulated time the run was stopped at, once enough measured requests had missed an SLO
    that the attainment could no longer reach ``simulate_fleet``'s ``give_up_below`` (None:
    it ran to the end). A stopped run's lists hold only the requests finished by then."""

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """Share of measured requests within both SLOs."""
        ok = sum(within_slos(t, p, ttft_slo_s, tpot_slo_s)
                 for t, p in zip(self.ttft_s, self.tpot_s, strict=True))
        return ok / len(self.ttft_s) if self.ttft_s else 0.0


class _Job:
    __slots__ = ("req", "route", "decoder", "pd", "first_s", "measured", "missed")

    def __init__(self, req: SimRequest, route: RouteRequest, decoder: ColocatedEngine[_Job],
                 pd: bool, measured: bool) -> None:
        self.req, self.route, self.decoder, self.pd = req, route, decoder, pd
        self.measured = measured
        self.first_s = 0.0
        """When its first token is out (0.0: not known yet)."""
        self.missed = False
        """Counted among the run's known misses (:class:`_Misses`)."""


class _Misses:
    """The measured requests known to miss an SLO while the run goes on: a TTFT past its SLO
    with no first token yet (its deadline passed), or a finished request past either SLO. Once
    the rest are too few to reach ``give_up_below`` of the measured requests (:attr:`hopeless`),
    the run's attainment ends below it whatever they do."""

    def __init__(self, measured: int, give_up_below: float, ttft_slo_s: float) -> None:
        self.measured = measured
        self.give_up_below = give_up_below
        self.ttft_slo_s = ttft_slo_s
        self.count = 0
        self.deadlines: list[tuple[float, int, _Job]] = []
        """(arrival + TTFT SLO, order watched, job) of measured requests, earliest first."""

    @property
    def hopeless(self) -> bool:
        """At most ``measured - count`` can meet both SLOs: under the threshold already."""
        return (self.measured - self.count) / self.measured < self.give_up_below

    def watch(self, job: _Job) -> None:
        """Count ``job`` as a miss if its TTFT deadline passes with no first token."""
        heapq.heappush(self.deadlines, (job.req.arrival_s + self.ttft_slo_s,
                                        job.req.index, job))

    def miss(self, job: _Job) -> None:
        """``job`` missed an SLO (counted once)."""
        if not job.missed:
            job.missed = True
            self.count += 1

    def passed(self, now: float) -> None:
        """Count the watched requests whose TTFT deadline is before ``now`` with no first
        token (whenever it comes, it comes at ``now`` or later)."""
        deadlines = self.deadlines
        while deadlines and deadlines[0][0] < now:
            job = heapq.heappop(deadlines)[2]
            if job.first_s == 0.0 and now - job.req.arrival_s > self.ttft_slo_s:
                self.miss(job)


class _Held:
    __slots__ = ("prefiller", "job", "waiting", "sent")

    def __init__(self, prefiller: ColocatedEngine[_Job], job: _Job, waiting: int) -> None:
        self.prefiller, self.job, self.waiting, self.sent = prefiller, job, waiting, False


_ENGINE, _PULLED, _SEND = 0, 1, 2


class _Run:
    """One replay: the engines, the policy, the event heap."""

    def __init__(self, fleet: Fleet, s: FleetSettings) -> None:
        self.s, self.fleet = s, fleet
        self.engines = [ColocatedEngine[_Job](f"e{i:03d}", role, s.costs, s.chunk_tokens,
                                              s.cache_blocks)
                        for i, role in enumerate(fleet.roles)]
        self.by_id = {e.wid: e for e in self.engines}
        self.paths = AdaptivePaths(s.costs, s.ttft_slo_s, s.tpot_slo_s,
                                   capacity_blocks=s.cache_blocks, block_tokens=s.block_tokens,
                                   defer=fleet.defer)
        self.events: list[tuple[float, int, int, object, int]] = []
        self.waiters: dict[str, list[_Held]] = {}
        """Request id -> the held requests waiting for it to end."""
        self.seq = 0
        self.res = FleetResult()
        self.misses: _Misses | None = None
        """Known misses, when the run may stop early (``give_up_below``)."""

    def push(self, t: float, kind: int, payload: object, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload, version))

    def wake(self, e: ColocatedEngine[_Job], now: float) -> None:
        end = e.wake(now)
        if end is not None:
            self.push(end, _ENGINE, e, e.version)

    def arrive(self, req: SimRequest, now: float) -> None:
        route = RouteRequest(str(req.index), MODEL, block_hashes=req.block_hashes,
                             num_prompt_tokens=req.prompt_tokens)
        prefiller, decoder, plan = self.place(route, req, now)
        job = _Job(req, route, decoder, decoder is not prefiller, now >= self.s.warmup_s)
        if job.measured and self.misses is not None:
            self.misses.watch(job)
        prefiller.in_flight += 1
        if decoder is not prefiller:
            decoder.in_flight += 1
        if plan is None or not plan.waits_for:
            self.send(prefiller, job, now)
            return
        # held, as the router holds it: sent when the answers it waits for have ended, or at
        # its limit (``hold_limit_s``); they are in flight (the policy took them from its own
        # in-flight state, which ``done`` updates)
        held = _Held(prefiller, job, len(plan.waits_for))
        for rid in plan.waits_for:
            self.waiters.setdefault(rid, []).append(held)
        self.push(now + hold_limit_s(plan, self.s.ttft_slo_s), _SEND, held)

    def send(self, prefiller: ColocatedEngine[_Job], job: _Job, now: float) -> None:
        cached = self.cached_tokens(prefiller, job.req)
        prefiller.add_prefill(job, job.req.prompt_tokens - cached, cached)
        self.wake(prefiller, now)

    def release(self, held: _Held, now: float) -> None:
        """Send a held request (once: its last awaited answer ended, or its deadline came)."""
        if not held.sent:
            held.sent = True
            self.paths.released(held.job.route.request_id, now)
            self.send(held.prefiller, held.job, now)

    def place(self, route: RouteRequest, req: SimRequest, now: float
              ) -> tuple[ColocatedEngine[_Job], ColocatedEngine[_Job], PlanEstimate | None]:
        """The engines that prefill and decode ``route`` (the same one: whole), planned by
        the adaptive policy."""
        cands = [(e.role, Candidate(e.wid, e.in_flight, False, 0, e.running))
                 for e in self.engines]
        loads = self.paths.loads(route, cands, now)
        decision = self.paths.decide(route, req.output_tokens, loads, force=self.fleet.force)
        assert decision is not None  # every fleet has engines for its paths
        plan = decision.plan
        self.paths.dispatched(route, plan, req.output_tokens, now, sensitive=decision.sensitive)
        self.res.paths[plan.path] += 1
        self.res.reasons[decision.reason] += 1
        return self.by_id[plan.prefill_worker or plan.worker], self.by_id[plan.worker], plan

    def cached_tokens(self, e: ColocatedEngine[_Job], req: SimRequest) -> int:
        """Prompt tokens of ``req`` that ``e``'s cache holds and the engine reuses (never the
        whole prompt; whole engine blocks only when ``engine_block_tokens`` is set)."""
        hit = min(e.cache.match(req.block_hashes) * self.s.block_tokens, req.prompt_tokens - 1)
        unit = self.s.engine_block_tokens
        return max(hit // unit * unit if unit else hit, 0)

    def released(self, job: _Job) -> None:
        """``job``'s last token is out: tell the policy."""
        self.paths.finished(job.route.request_id)

    def prefilled(self, e: ColocatedEngine[_Job], job: _Job, now: float) -> None:
        """``job``'s prefill on ``e`` ended: the policy hears it (as the router does from the
        prefill's answer or the first token), then the decode starts or the KV moves."""
        self.paths.prefilled(job.route.request_id, now)
        e.cache.insert(job.route.block_hashes)
        c = self.s.costs
        if not job.pd:
            job.first_s = now
            self.start_decode(job, now)
            return
        e.in_flight -= 1
        job.first_s = now + c.hop_s
        self.push(job.first_s + job.req.prompt_tokens * c.pull_s_per_token, _PULLED, job)

    def start_decode(self, job: _Job, now: float) -> None:
        if job.req.output_tokens > 1:
            job.decoder.add_decode(job, job.req.output_tokens - 1)
        else:
            self.done(job, max(now, job.first_s))

    def done(self, job: _Job, now: float) -> None:
        self.released(job)
        for held in self.waiters.pop(job.route.request_id, ()):
            held.waiting -= 1
            if held.waiting == 0:
                self.release(held, now)
        job.decoder.in_flight -= 1
        if job.measured:
            out = job.req.output_tokens
            ttft_s = job.first_s - job.req.arrival_s
            tpot_s = (now - job.first_s) / (out - 1) if out > 1 else 0.0
            self.res.ttft_s.append(ttft_s)
            self.res.tpot_s.append(tpot_s)
            if self.misses is not None and not within_slos(ttft_s, tpot_s, self.s.ttft_slo_s,
                                                           self.s.tpot_slo_s):
                self.misses.miss(job)

    def run(self, requests: Iterable[SimRequest], give_up_below: float | None = None
            ) -> FleetResult:
        """Replay ``requests``; with ``give_up_below``, stop once the measured requests known
        to miss an SLO make an attainment of at least that impossible (``FleetResult.
        stopped_s``)."""
        if give_up_below is not None:
            requests = list(requests)
            measured = sum(1 for r in requests if r.arrival_s >= self.s.warmup_s)
            if measured:
                self.misses = _Misses(measured, give_up_below, self.s.ttft_slo_s)
        misses = self.misses
        events = self.events
        it = iter(requests)
        nxt = next(it, None)
        while nxt is not None or events:
            arrival = nxt is not None and (not events or nxt.arrival_s <= events[0][0])
            if misses is not None:
                t = nxt.arrival_s if arrival else events[0][0]  # type: ignore[union-attr]
                misses.passed(t)
                if misses.hopeless:
                    self.res.stopped_s = t
                    return self.res
            if arrival:
                assert nxt is not None
                req, nxt = nxt, next(it, None)
                self.arrive(req, req.arrival_s)
                continue
            now, _, kind, payload, version = heapq.heappop(events)
            if kind == _SEND:
                assert isinstance(payload, _Held)
                self.release(payload, now)
                continue
            if kind == _PULLED:
                job = payload
                assert isinstance(job, _Job)
                job.decoder.cache.insert(job.route.block_hashes)
                self.start_decode(job, now)
                self.wake(job.decoder, now)
                continue
            e = payload
            assert isinstance(e, ColocatedEngine)
            if version != e.version:
                continue
            prefilled, finished = e.complete(now)
            for job in prefilled:
                self.prefilled(e, job, now)
            for job in finished:
                self.done(job, now)
            self.wake(e, now)
        busy = sum(e.busy_s for e in self.engines)
        self.res.prefill_share = sum(e.prefill_busy_s for e in self.engines) / busy if busy else 0
        return self.res


def simulate_fleet(requests: Iterable[SimRequest], fleet: Fleet, settings: FleetSettings,
                   give_up_below: float | None = None) -> FleetResult:
    """Replay ``requests`` (arrival times as given) on ``fleet``, every path planned by
    :class:`~router.policy.adaptive.AdaptivePaths` at ``settings``' SLOs and costs.
    ``give_up_below``: stop as soon as the attainment is known to end below it (a rate
    search needs only the verdict; an overloaded run's queues make every later decision
    slower)."""
    return _Run(fleet, settings).run(requests, give_up_below)
