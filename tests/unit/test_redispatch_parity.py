"""Re-dispatch, one rule for two drivers: at every re-dispatch of a simulated scale-up, the real
router's :class:`router.api.redispatch.Redispatcher`, given the same moment as the router sees
it, moves exactly the requests the simulator moves, to the same instances.

The simulator (DualMap placement, prefix-sharing prompts, 1 prefill instance growing to 3 while
a backlog waits) calls ``Pool.plan_redispatch`` on each join and interval. Each call is
recorded with the placement object as it was, and replayed through the router's seams at once:
a proxy over the same pool, the router's own ``LoadTracker`` holding each source's running
batch and queue (as the router books dispatches), the queued requests registered as waiting
streams, the workers' reports saying how many each queues, the targets joining between two
steps. Negative control: the same replay with each queue's order reversed (the router
mistaking which requests the engine still queues) moves other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from bench.sim.autoscale import ScriptedController
from bench.sim.engine import MODEL, Moves, simulate
from bench.sim.workload import SimRequest
from router.api.proxy import PDProxy
from router.api.redispatch import Redispatcher, Waiting
from router.config import RouterSettings
from router.metrics import RouterMetrics
from router.placement import Placement, Pool
from router.policy.base import RouteRequest
from router.policy.context import PolicyContext
from router.policy.load_model import LoadModel
from router.policy.rebalance import Move
from router.policy.registry import create_prefill_policy
from router.state.cluster import StaticCluster
from router.state.load import LoadTracker
from router.state.registry import WorkerRecord
from router.state.worker_load import WorkerLoad

Sources = Sequence[tuple[str, int, Sequence[tuple[RouteRequest, int]]]]


def _requests() -> list[SimRequest]:
    """A backlog from 30 s on: 60 long prompts over 6 shared prefixes (block hashes), 10 a
    second, on one prefill instance until two more join at 40 s."""
    out = []
    for i in range(60):  # 12,800 tokens each: 1.3 s of prefill, half of it a shared prefix
        prefix = tuple(range(10_000 * (i % 6), 10_000 * (i % 6) + 400))
        own = tuple(range(100_000 + 1000 * i, 100_000 + 1000 * i + 400))
        out.append(SimRequest(i, 30.0 + 0.1 * i, 16 * 800, 1, prefix + own))
    return out


def _record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id, "prefill", MODEL, "/nonexistent",  # type: ignore[arg-type]
                        "http://127.0.0.1:9", worker_id, "", 4096, 0.0)


def _router_moves(pool: Pool, sources: Sources, targets: dict[str, int], load: LoadModel,
                  max_moves: int, *, reverse: bool = False) -> list[tuple[str, str, str]]:
    """What the real router's re-dispatch moves at this moment: (request, from, to)."""
    tracker = LoadTracker()
    cluster = StaticCluster([_record(wid) for wid, _, _ in sources])
    client = httpx.AsyncClient()
    proxy = PDProxy(RouterSettings(), cluster, RouterMetrics(), Placement({"prefill": pool}),
                    tracker, client)
    moved: list[tuple[str, str, str]] = []
    for wid, ahead, queue in sources:
        if ahead:
            tracker.start(wid, f"running-on-{wid}", ahead, prefill=True)
        for route, tokens in (reversed(queue) if reverse else queue):
            tracker.start(wid, route.request_id, tokens, prefill=True)
            proxy.waiting.add(Waiting(route, "prefill", wid, 0.0,
                                      lambda target, r=route.request_id, w=wid:
                                      moved.append((r, w, target.worker_id)) is None))
    for wid, tail in targets.items():
        if tail:
            tracker.start(wid, f"running-on-{wid}", tail, prefill=True)

    def report(wid: str, running: int, waiting: int) -> WorkerLoad:
        return WorkerLoad(running, waiting, 0.0, own_in_flight=tracker.in_flight(wid),
                          scraped_at_s=1.0)

    reports = {wid: report(wid, 1, len(queue)) for wid, _, queue in sources}
    redispatch = Redispatcher(proxy, 1.0, load.per_token_s, max_moves=max_moves)
    proxy.reported_loads = lambda: reports
    redispatch.step()  # the step before the targets joined
    cluster.records += tuple(_record(wid) for wid in targets)  # they join
    reports.update({wid: report(wid, 1 if tail else 0, 0) for wid, tail in targets.items()})
    redispatch.step()
    asyncio.run(client.aclose())
    return moved


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every simulated re-dispatch (not an evacuation), with the router's replays beside it."""
    calls: list[dict[str, Any]] = []
    plan = Pool.plan_redispatch
    replaying: list[bool] = []

    def recorded(self: Pool, sources: Sources, targets: dict[str, int], load: LoadModel,
                 evacuate: Sequence[str] = (), max_moves: int = 64) -> list[Move]:
        moves = plan(self, sources, targets, load, evacuate, max_moves)
        if evacuate or replaying:  # an evacuation, or the router's own call in a replay
            return moves
        replaying.append(True)
        try:
            calls.append({
                "sim": [(m.request_id, m.source, m.target) for m in moves],
                "router": _router_moves(self, sources, dict(targets), load, max_moves),
                "reversed": _router_moves(self, sources, dict(targets), load, max_moves,
                                          reverse=True)})
        finally:
            replaying.clear()
        return moves

    monkeypatch.setattr(Pool, "plan_redispatch", recorded)
    yield calls


def test_the_router_moves_what_the_simulator_moves(replays: list[dict[str, Any]]) -> None:
    ctl = ScriptedController((1, 1), [(10.0, 3, 1)], interval_s=10.0)
    policy = create_prefill_policy("dualmap", PolicyContext(ttft_slo_s=2.0))
    res = simulate(_requests(), policy, 0, 0, controller=ctl, start_delay_s=30.0,
                   moves=Moves(on_tick=True))
    moving = [c for c in replays if c["sim"]]
    # not vacuous: both joins moved part of the backlog (17 and 12 requests when written)
    assert res.redispatched["join"] >= 10 and len(moving) == 2
    for call in replays:
        assert call["router"] == call["sim"]
    # negative control: the same moments with the queues misread move other requests
    assert any(c["reversed"] != c["sim"] for c in moving)
