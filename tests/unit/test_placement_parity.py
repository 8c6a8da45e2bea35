"""One placement object, two drivers: the router's proxy and the simulator choose alike.

The simulator replays a prefix-heavy workload and logs every placement event (dispatch and
finish, prefill and decode) in the order it happened. The same sequence is then driven through
the router's proxy seam (``PDProxy.choose`` / ``begin`` / ``end`` over a static cluster whose
workers carry the simulator's ids, the router's own ``LoadTracker`` as ledger): every worker the
router picks must be the one the simulator picked. Negative controls: a router with another
prefill (or decode) policy diverges on the same sequence, so the comparison is not vacuous.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from bench.sim.engine import MODEL, simulate
from bench.sim.workload import WorkloadConfig, build_requests
from bench.synth import gamma_rows
from router.api.proxy import PDProxy
from router.autoscale.profile import DecodePerf, PrefillPerf
from router.config import RouterSettings
from router.metrics import RouterMetrics
from router.placement import Placement
from router.policy.base import Dispatched, Finished, PolicyEvent, RouteRequest
from router.policy.context import PolicyContext
from router.policy.registry import create_decode_policy, create_prefill_policy
from router.state.cluster import StaticCluster
from router.state.load import LoadTracker
from router.state.registry import WorkerRecord

N_PREFILL, N_DECODE = 6, 3
CONTEXT = PolicyContext(ttft_slo_s=2.0)


def _sim_log(prefill: str) -> tuple[list[tuple[str, PolicyEvent]], dict[str, RouteRequest]]:
    """Placement events of one simulated run (busy enough that loads and caches matter)."""
    rows = gamma_rows(400, rate_rps=60.0, seed=3)
    reqs = build_requests(rows, WorkloadConfig(hot_share=0.3), seed=3)
    log: list[tuple[str, PolicyEvent]] = []
    simulate(reqs, create_prefill_policy(prefill, CONTEXT), N_PREFILL, N_DECODE, PrefillPerf(),
             DecodePerf(), decode_policy=create_decode_policy("kv_aware", CONTEXT),
             observer=lambda role, event: log.append((role, event)))
    routes = {str(r.index): RouteRequest(str(r.index), MODEL, block_hashes=r.block_hashes,
                                         num_prompt_tokens=r.prompt_tokens) for r in reqs}
    return log, routes


def _record(worker_id: str, role: str) -> WorkerRecord:
    return WorkerRecord(worker_id, role, MODEL, "/nonexistent", "http://127.0.0.1:9",  # type: ignore[arg-type]
                        worker_id, "", 4096, 0.0)


def _router_replay(log: list[tuple[str, PolicyEvent]], routes: dict[str, RouteRequest],
                   prefill: str, decode: str) -> list[tuple[str, str, str]]:
    """Drive the logged sequence through the proxy; (role, request, worker) per dispatch."""
    records = [_record(f"p{i:04d}", "prefill") for i in range(N_PREFILL)] + \
        [_record(f"d{i:04d}", "decode") for i in range(N_DECODE)]
    tracker = LoadTracker()
    client = httpx.AsyncClient()
    proxy = PDProxy(RouterSettings(), StaticCluster(records), RouterMetrics(),
                    Placement.create(prefill, decode, CONTEXT, tracker), tracker, client)
    by_id = {r.worker_id: r for r in records}
    picks = []
    try:
        for role, event in log:
            if isinstance(event, Dispatched):
                route = routes[event.request_id]
                worker = proxy.choose(role, route, set())
                assert worker is not None
                picks.append((role, route.request_id, worker.worker_id))
                # book what the simulator did (so a divergence does not cascade)
                proxy.begin(role, route, by_id[event.worker_id])
            elif isinstance(event, Finished):
                proxy.end(role, routes[event.request_id], by_id[event.worker_id], event.ok)
    finally:
        asyncio.run(client.aclose())
    return picks


def _sim_picks(log: list[tuple[str, PolicyEvent]]) -> list[tuple[str, str, str]]:
    return [(role, e.request_id, e.worker_id) for role, e in log if isinstance(e, Dispatched)]


def test_router_and_simulator_make_the_same_placements() -> None:
    log, routes = _sim_log("dualmap")
    sim = _sim_picks(log)
    router = _router_replay(log, routes, "dualmap", "kv_aware")
    assert len(sim) == 2 * len(routes) == 800
    assert router == sim
    # not a degenerate run: every instance is used, the decode choice is load-driven
    used = Counter((role, w) for role, _, w in sim)
    assert len(used) == N_PREFILL + N_DECODE
    assert any(isinstance(e, Finished) for _, e in log[:len(log) // 4])  # interleaved


def test_a_different_policy_diverges_on_the_same_sequence() -> None:
    log, routes = _sim_log("dualmap")
    sim = _sim_picks(log)
    prefill_only = [p for p in sim if p[0] == "prefill"]
    other_prefill = _router_replay(log, routes, "consistent_hash", "kv_aware")
    assert [p for p in other_prefill if p[0] == "prefill"] != prefill_only
    decode_only = [p for p in sim if p[0] == "decode"]
    other_decode = _router_replay(log, routes, "dualmap", "round_robin")
    assert [p for p in other_decode if p[0] == "decode"] != decode_only
    # and the simulator with another policy chooses differently too
    assert _sim_picks(_sim_log("round_robin")[0]) != sim
