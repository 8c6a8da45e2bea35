"""Warm before traffic in the router (``router.api.warm``): a prefill worker that joins gets the
recent prompts placement would now send it, as one-token requests, through the proxy's seams
(the in-memory cluster and scripted workers of ``test_proxy_retry_relay``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from router.api.warm import Warmer
from router.policy.base import RouteRequest
from router.policy.hashing import block_hashes
from router.samples import parse_samples, total
from tests.unit import test_proxy_retry_relay as relay
from tests.unit.test_proxy_retry_relay import MODEL, Rig

rig_of = relay.rig_of
"""The proxy over scripted workers (a fixture of ``test_proxy_retry_relay``)."""

ANSWER = {"choices": [{"text": "x", "index": 0, "finish_reason": "length"}]}
PROMPTS = [tuple(range(1000 * i, 1000 * i + 64)) for i in range(1, 13)]
"""Twelve prompts of four 16-token blocks, no prefix shared."""


def routes() -> list[RouteRequest]:
    return [RouteRequest(request_id=f"r{i}", model=MODEL, prompt_token_ids=ids,
                         block_hashes=block_hashes(ids)) for i, ids in enumerate(PROMPTS)]


def counted(rig: Rig, name: str, **labels: str) -> float:
    return total(parse_samples(rig.metrics.render().decode()), name, **labels)


def serve_on_p1(rig: Rig, warmer: Warmer) -> None:
    """Every prompt served by p1 (booked through placement: the cache model now has them
    there), and seen by the warmer."""
    p1 = next(r for r in rig.cluster.records if r.worker_id == "p1")
    for route in routes():
        warmer.saw(route)
        rig.proxy.begin("prefill", route, p1)
        rig.proxy.end("prefill", route, p1, ok=True)


async def served_then_join(rig: Rig, warmer: Warmer, *, joins: str = "p2") -> list[str]:
    """:func:`serve_on_p1` while ``joins`` is out, then it joins; returns the workers the
    warm requests went to."""
    newcomer = next(r for r in rig.cluster.records if r.worker_id == joins)
    rig.cluster.records.remove(newcomer)
    serve_on_p1(rig, warmer)
    rig.cluster.join(newcomer)
    await warmer.settled()
    return rig.workers.calls


@pytest.mark.parametrize(("policy", "budget", "joins", "warmed"), [
    ("dualmap", 16384, "p2", True),
    ("round_robin", 16384, "p2", False),  # control: no cache model, no peer known to cache it
    ("dualmap", 0, "p2", False),          # control: warming off
    ("dualmap", 16384, "d2", False),      # control: a decode worker pulls, never warmed
])
async def test_a_joining_prefill_worker_gets_the_prompts_placement_now_sends_it(
        rig_of: Callable[..., Rig], policy: str, budget: int, joins: str, warmed: bool
        ) -> None:
    scripts: dict[str, Any] = {"p1": [], "p2": [ANSWER] * len(PROMPTS), "d1": [], "d2": []}
    rig = rig_of({"policy": policy}, **scripts)
    warmer = Warmer(rig.proxy, budget)
    warmer.start()
    calls = await served_then_join(rig, warmer, joins=joins)
    pool = rig.proxy.placement.pool("prefill")
    if not warmed:
        assert calls == [] and counted(rig, "pdserve_router_warm_requests_total") == 0
        return
    # two workers: p2 is every prompt's spill target (where it goes when p1, caching it, is
    # too busy); the budget covers them all
    goes = {r.request_id for r in routes()}
    assert calls == ["p2"] * len(PROMPTS)
    sent = {tuple(body["prompt"]) for body in rig.workers.bodies}
    assert sent == {r.prompt_token_ids for r in routes() if r.request_id in goes}
    assert all(body["max_tokens"] == 1 and body["model"] == MODEL for body in rig.workers.bodies)
    # the cache model has them on p2 now; the ledger holds nothing
    assert all(pool.cached_tokens(r, "p2") == 64 for r in routes() if r.request_id in goes)
    assert rig.in_flight() == {}
    assert counted(rig, "pdserve_router_warm_requests_total", outcome="ok") == len(calls)
    assert counted(rig, "pdserve_router_warm_tokens_total") == 64 * len(calls)


@pytest.mark.parametrize(("joins", "warms"), [("p2", True), ("d2", False)])  # control: decode
async def test_a_joining_worker_is_counted_as_warming_until_its_warm_ends(
        rig_of: Callable[..., Rig], joins: str, warms: bool) -> None:
    """``pdserve_router_warming_workers`` is 1 from the membership update that adds the worker
    (a client that sees it joined never sees it idle before its warm) and 0 once it ends."""
    rig = rig_of({"policy": "dualmap"}, p1=[], p2=[ANSWER] * len(PROMPTS), d1=[], d2=[])
    warmer = Warmer(rig.proxy, 16384)
    warmer.start()
    at_join: list[float] = []  # told after the warmer, in the same membership update
    rig.cluster.on_join(lambda _: at_join.append(counted(rig, "pdserve_router_warming_workers")))
    calls = await served_then_join(rig, warmer, joins=joins)
    assert at_join == [1 if warms else 0]
    assert counted(rig, "pdserve_router_warming_workers") == 0
    assert bool(calls) == warms


async def test_the_budget_bounds_the_warm_tokens(rig_of: Callable[..., Rig]) -> None:
    rig = rig_of({"policy": "dualmap"}, p1=[], p2=[ANSWER] * len(PROMPTS), d1=[])
    warmer = Warmer(rig.proxy, 128)  # two prompts' worth
    warmer.start()
    calls = await served_then_join(rig, warmer)
    assert len(calls) == 2


async def test_a_failed_warm_request_is_counted_and_leaves_nothing_booked(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of({"policy": "dualmap"}, p1=[], p2=[500] * len(PROMPTS), d1=[])
    warmer = Warmer(rig.proxy, 16384)
    warmer.start()
    calls = await served_then_join(rig, warmer)
    assert calls and counted(rig, "pdserve_router_warm_requests_total",
                             outcome="error") == len(calls)
    assert counted(rig, "pdserve_router_warm_tokens_total") == 0
    assert rig.in_flight() == {} and rig.cluster.evicted == []


async def test_only_the_prompts_whose_spill_target_is_the_newcomer(rig_of: Callable[..., Rig]
                                                                   ) -> None:
    """Three prefill workers: p1 served every prompt, p2 is a member, p3 joins. A prompt
    spills (its first choice, p1, too busy) to p2 or p3 by placement's own choice; p3 is
    warmed with those it would take, not the others (control: they exist, or the check would
    pass on any subset)."""
    rig = rig_of({"policy": "dualmap"}, p1=[], p2=[], p3=[ANSWER] * len(PROMPTS), d1=[])
    warmer = Warmer(rig.proxy, 16384)
    warmer.start()
    pool = rig.proxy.placement.pool("prefill")
    p3 = next(r for r in rig.cluster.records if r.worker_id == "p3")
    rig.cluster.records.remove(p3)
    serve_on_p1(rig, warmer)
    # placement's choices as the join finds them: p1 first (it caches them all), then p2 or p3
    rig.cluster.records.append(p3)
    pool.sync(MODEL, ["p1", "p2", "p3"])
    candidates = rig.proxy.pool("prefill", MODEL)
    to_p3 = set()
    for r in routes():
        first = pool.choose(r, candidates)
        assert first is not None and first.worker == "p1"
        spill = pool.choose(r, [c for c in candidates if c.worker_id != "p1"])
        if spill is not None and spill.worker == "p3":
            to_p3.add(r.prompt_token_ids)
    assert 0 < len(to_p3) < len(PROMPTS)
    rig.cluster.records.remove(p3)
    rig.cluster.join(p3)
    await warmer.settled()
    calls = rig.workers.calls
    assert calls == ["p3"] * len(to_p3)
    assert {tuple(body["prompt"]) for body in rig.workers.bodies} == to_p3
