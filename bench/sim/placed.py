"""Whole-serving engines behind the router's placement object: a simulated ``pdserve up --mode
aggregated`` cluster whose every request is placed by a prefill placement policy (DualMap, a
peer's, a baseline), exactly as the router's aggregated pool places it.

Each engine is a :class:`~bench.sim.colocated.ColocatedEngine` (prefill chunks and decode steps in
the same iterations). Placement is :class:`router.placement.Pool` over these engines: per arrival
``choose`` among candidates carrying the router's own accounting (its ``LoadTracker``: requests
in flight, uncached prompt tokens dispatched and not finished; and the engines' running
sequences), ``begin`` at once and
``end`` when the last token is out, as the router's proxy does for a whole request. The run itself
is :mod:`bench.sim.fleet`'s, so timing, prefix caches and results are the same as its fleets'.
"""

from __future__ import annotations

from collections.abc import Iterable

from bench.sim.colocated import ColocatedEngine
from bench.sim.fleet import MODEL, Fleet, FleetResult, FleetSettings, _Job, _Run
from bench.sim.workload import SimRequest
from router.placement import Pool
from router.policy.base import Candidate, PlacementPolicy, RouteRequest
from router.policy.path_cost import PlanEstimate
from router.state.load import LoadTracker

ROLE = "aggregated"


class _PlacedRun(_Run):
    def __init__(self, n: int, policy: PlacementPolicy, s: FleetSettings) -> None:
        super().__init__(Fleet(ROLE, (ROLE,) * n), s)
        self.ledger = LoadTracker()  # the router's own accounting
        self.pool = Pool(ROLE, policy, self.ledger)
        self.pool.sync(MODEL, [e.wid for e in self.engines])

    def place(self, route: RouteRequest, req: SimRequest, now: float
              ) -> tuple[ColocatedEngine[_Job], ColocatedEngine[_Job], PlanEstimate | None]:
        ledger = self.ledger
        candidates = [Candidate(e.wid, ledger.in_flight(e.wid), False,
                                ledger.pending_tokens(e.wid), e.running) for e in self.engines]
        choice = self.pool.choose(route, candidates)
        assert choice is not None  # every engine is a candidate
        self.pool.begin(route, choice.worker)
        self.res.paths["whole"] += 1
        self.res.reasons[choice.reason] += 1
        engine = self.by_id[choice.worker]
        return engine, engine, None

    def released(self, job: _Job) -> None:
        self.pool.end(job.route, job.decoder.wid)


def simulate_placed(requests: Iterable[SimRequest], n: int, policy: PlacementPolicy,
                    settings: FleetSettings) -> FleetResult:
    """Replay ``requests`` (arrival times as given) on ``n`` whole-serving engines, each request
    placed by ``policy`` through the router's placement pool."""
    return _PlacedRun(n, policy, settings).run(requests)
