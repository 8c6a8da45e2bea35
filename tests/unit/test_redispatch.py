"""Re-dispatch in the real router (``router.api.redispatch``): a stream still queued in its
worker's engine moves to a worker of its pool that can start it sooner, through the proxy's
seams (the in-memory cluster and scripted workers of ``test_proxy_retry_relay``).

Each move is checked from the outside: which workers were called, what the client received,
the old connection closed (vLLM aborts the request), the counters and the ledger. Each test
that moves has a control that differs in the one fact the rule reads and does not move.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest

from router.api import resume
from router.api.redispatch import Redispatcher, Waiting, WaitingRequests, queued_now
from router.api.schemas import COMPLETIONS
from router.api.timeline import PhaseClock
from router.policy.base import RouteRequest
from router.samples import parse_samples, total
from router.state.worker_load import WorkerLoad
from tests.unit import test_proxy_retry_relay as relay
from tests.unit.test_proxy_retry_relay import EVENTS, Rig, Script, decode, play, record

rig_of = relay.rig_of
"""The proxy over scripted workers (a fixture of ``test_proxy_retry_relay``)."""

HUNG = Script([], hang=True)
"""A request the engine queues: the connection is open and nothing comes back yet."""


def load(running: int, waiting: int) -> WorkerLoad:
    """A fresh report, scraped now."""
    return WorkerLoad(running=running, waiting=waiting, kv_usage=0.0,
                      scraped_at_s=time.monotonic())


def redispatches(rig: Rig, role: str) -> float:
    return total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_redispatches_total", role=role)


async def waiting_on(rig: Rig, worker_id: str, n: int = 1) -> None:
    """Until ``n`` streams are registered as waiting on ``worker_id``."""
    async with asyncio.timeout(5):
        while len(rig.proxy.waiting.on(worker_id)) < n:
            await asyncio.sleep(0.01)


async def start_stream(rig: Rig) -> asyncio.Task[bytes]:
    """A client's stream whose decode is queued on d1 (d2 is not a member yet)."""
    d2 = next(r for r in rig.cluster.records if r.worker_id == "d2")
    rig.cluster.records.remove(d2)
    response = await decode(rig, stream=True)
    client = asyncio.create_task(play(response))
    await waiting_on(rig, "d1")
    rig.cluster.records.append(d2)  # it joins
    return client


async def test_a_queued_decode_moves_to_a_worker_that_joined(rig_of: Callable[..., Rig]
                                                             ) -> None:
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    client = await start_stream(rig)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 1
    received = (await asyncio.wait_for(client, 5)).decode()
    # the client got the whole answer, from d2, once; d1's connection was closed (an abort)
    assert "".join(json.loads(line[6:])["choices"][0]["text"]
                   for line in received.split("\n\n") if line.startswith("data: {")) == "abc"
    assert received.endswith("data: [DONE]\n\n") and '"error"' not in received
    assert rig.workers.calls == ["d1", "d2"] and rig.workers.streams[0].closed
    # d1 may have taken the prefill's params: d2 computes the prompt itself
    assert "kv_transfer_params" in rig.workers.bodies[0]
    assert "kv_transfer_params" not in rig.workers.bodies[1]
    assert redispatches(rig, "decode") == 1 and rig.retries("decode") == 0
    assert rig.cluster.evicted == [] and not rig.tracker.recently_failed("d1")
    assert rig.in_flight() == {} and rig.proxy.waiting.workers() == []


async def test_a_move_wakes_the_waiting_stream_at_once(rig_of: Callable[..., Rig],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream waiting for its first chunk looks at a move when asked, not at its next
    probe check (an hour away here): the longer a move waits, the likelier the request starts
    on its old worker first and stays."""
    monkeypatch.setattr(resume, "PROBE_CHECK_S", 3600.0)
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    client = await start_stream(rig)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 1
    assert '"text":"c"' in (await asyncio.wait_for(client, 5)).decode()
    assert rig.workers.calls == ["d1", "d2"] and redispatches(rig, "decode") == 1


async def test_an_adaptive_fleets_decodes_stay_where_the_path_policy_put_them(
        rig_of: Callable[..., Rig]) -> None:
    """The test above with flex workers (an adaptive fleet): the same queue and the same idle
    newcomer, and nothing moves. The path policy placed the decode (on a quiet decoder, away
    from the engine prefilling), and a flex engine counts a decode pulling its KV as waiting:
    a move would recompute the prompt on an engine the split keeps prefilling."""
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    rig.cluster.records[:] = [record(r.worker_id, "flex" if r.role == "decode" else r.role)
                              for r in rig.cluster.records]
    client = await start_stream(rig)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 0
    await asyncio.sleep(0.6)  # past two of the stream's looks at a move
    assert rig.workers.calls == ["d1"] and not rig.workers.streams[0].closed
    assert redispatches(rig, "decode") == 0
    client.cancel()


@pytest.mark.parametrize(("reports", "why"), [
    ({"d1": load(2, 0), "d2": load(0, 0)}, "d1 queues nothing: the request is running there"),
    ({"d1": load(2, 1), "d2": load(0, 1)}, "d2 queues work too"),
    ({"d1": load(2, 1)}, "d2 has not reported its load yet"),
    ({"d1": load(2, 1), "d2": load(1, 0)}, "d2 is busy, and no step saw it join"),
])
async def test_no_move_when_the_rule_sees_no_gain(rig_of: Callable[..., Rig],
                                                  reports: dict[str, WorkerLoad], why: str
                                                  ) -> None:
    """Negative controls of the test above: one fact differs each time."""
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    client = await start_stream(rig)
    rig.proxy.reported_loads = lambda: reports
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 0, why
    await asyncio.sleep(0.6)  # past two of the stream's looks at a move
    assert rig.workers.calls == ["d1"] and not rig.workers.streams[0].closed
    assert redispatches(rig, "decode") == 0
    client.cancel()


@pytest.mark.parametrize(("d2_before", "d2_report", "moves", "later"), [
    (False, None, 1, 0),        # joined, not scraped yet: nothing of the router's runs there
    (False, load(1, 0), 1, 0),  # joined, already took a new arrival: less ahead than on d1
    # control: joined, but as much ahead of a newcomer as on d1; still joined (no move to
    # it made) when it has less ahead at the next step
    (False, load(2, 0), 0, 1),
    # control: joined, and it queues already (a target once its queue is gone)
    (False, load(0, 1), 0, 1),
    (True, load(1, 0), 0, 0),   # control: busy and a member at the last step (not new, not idle)
    (True, None, 0, 0),         # control: a member at the last step, never scraped
])
async def test_a_worker_that_joined_is_a_target_until_a_move_to_it_is_made(
        rig_of: Callable[..., Rig], d2_before: bool, d2_report: WorkerLoad | None,
        moves: int, later: int) -> None:
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    d2 = next(r for r in rig.cluster.records if r.worker_id == "d2")
    if not d2_before:
        rig.cluster.records.remove(d2)
    redispatch = Redispatcher(rig.proxy, 1.0, 1e-4)
    rig.proxy.reported_loads = lambda: {}
    assert redispatch.step() == 0  # the step before: d2 a member or not
    if d2_before:
        rig.cluster.records.remove(d2)
    client = asyncio.create_task(play(await decode(rig, stream=True)))
    await waiting_on(rig, "d1")
    rig.cluster.records.append(d2)
    reports = {"d1": load(2, 1)} | ({} if d2_report is None else {"d2": d2_report})
    rig.proxy.reported_loads = lambda: reports
    assert redispatch.step() == moves
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(1, 0)}
    assert redispatch.step() == later
    if moves or later:
        assert '"text":"c"' in (await asyncio.wait_for(client, 5)).decode()
        assert rig.workers.calls == ["d1", "d2"]
    else:
        assert rig.workers.calls == ["d1"]
        client.cancel()


async def test_a_joined_worker_is_no_target_once_a_move_to_it_was_made(
        rig_of: Callable[..., Rig]) -> None:
    """Two decodes queue on d1 when d2 joins with one sequence running: the head (it waited
    longest) moves. At the next step d2 is busy and took its move: the other stays, though it
    would gain (the step before shows the rule would move to d2 while it counts as joined)."""
    rig = rig_of(p1=[], d1=[HUNG, HUNG], d2=[Script(EVENTS)])
    d2 = next(r for r in rig.cluster.records if r.worker_id == "d2")
    rig.cluster.records.remove(d2)
    redispatch = Redispatcher(rig.proxy, 1.0, 1e-4)
    rig.proxy.reported_loads = lambda: {}
    assert redispatch.step() == 0  # the members before the join
    head = asyncio.create_task(play(await decode(rig, stream=True, request_id="head")))
    await waiting_on(rig, "d1")
    tail = asyncio.create_task(play(await decode(rig, stream=True, request_id="tail")))
    await waiting_on(rig, "d1", 2)
    rig.cluster.records.append(d2)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 2), "d2": load(1, 0)}
    assert redispatch.step() == 1
    assert '"text":"c"' in (await asyncio.wait_for(head, 5)).decode()
    assert not tail.done() and rig.workers.calls == ["d1", "d1", "d2"]
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(1, 0)}
    assert redispatch.step() == 0
    await asyncio.sleep(0.6)  # past two of the stream's looks at a move
    assert rig.workers.calls == ["d1", "d1", "d2"] and redispatches(rig, "decode") == 1
    tail.cancel()


@pytest.mark.parametrize("listening", [True, False])
async def test_a_join_is_planned_in_the_membership_update_that_adds_the_worker(
        rig_of: Callable[..., Rig], listening: bool) -> None:
    """The cluster tells the started Redispatcher of a join at once: the queued decode moves
    without waiting for a step of the loop (an hour away here). Control: the same join with
    no listener (the loop's step not due) moves nothing."""
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    d2 = next(r for r in rig.cluster.records if r.worker_id == "d2")
    rig.cluster.records.remove(d2)
    redispatch = Redispatcher(rig.proxy, 3600.0, 1e-4)
    if listening:
        redispatch.start()
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1)}  # d2 never scraped
    redispatch.step()  # the members before the join
    client = asyncio.create_task(play(await decode(rig, stream=True)))
    await waiting_on(rig, "d1")
    rig.cluster.join(d2)
    try:
        if listening:
            assert '"text":"c"' in (await asyncio.wait_for(client, 5)).decode()
            assert rig.workers.calls == ["d1", "d2"] and redispatches(rig, "decode") == 1
        else:
            await asyncio.sleep(0.6)  # past two of the stream's looks at a move
            assert rig.workers.calls == ["d1"] and redispatches(rig, "decode") == 0
            client.cancel()
    finally:
        await redispatch.close()


async def test_a_request_sent_after_the_scrape_is_not_counted_as_queued(
        rig_of: Callable[..., Rig]) -> None:
    """The report predates the request: its ``waiting`` is someone else's."""
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    stale = load(2, 1)
    client = await start_stream(rig)
    rig.proxy.reported_loads = lambda: {"d1": stale, "d2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 0
    assert rig.workers.calls == ["d1"]
    client.cancel()


async def test_a_stream_that_answered_never_moves(rig_of: Callable[..., Rig]) -> None:
    """Running work stays: once its worker sent a chunk the stream is not waiting."""
    rig = rig_of(p1=[], d1=[Script(EVENTS[:1], hang=True)], d2=[Script(EVENTS)])
    d2 = next(r for r in rig.cluster.records if r.worker_id == "d2")
    rig.cluster.records.remove(d2)
    client = asyncio.create_task(play(await decode(rig, stream=True)))
    async with asyncio.timeout(5):
        while not rig.workers.streams or rig.proxy.waiting.on("d1"):
            await asyncio.sleep(0.01)
    rig.cluster.records.append(d2)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 0
    assert rig.workers.calls == ["d1"]
    client.cancel()


async def test_a_request_moves_once_in_its_life(rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(p1=[], d1=[HUNG], d2=[HUNG], d3=[Script(EVENTS)])
    d3 = next(r for r in rig.cluster.records if r.worker_id == "d3")
    rig.cluster.records.remove(d3)
    client = await start_stream(rig)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(0, 0)}
    redispatch = Redispatcher(rig.proxy, 1.0, 1e-4)
    assert redispatch.step() == 1
    await waiting_on(rig, "d2")
    rig.cluster.records.append(d3)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 0), "d2": load(2, 1), "d3": load(0, 0)}
    assert redispatch.step() == 0
    assert rig.workers.calls == ["d1", "d2"]
    client.cancel()


async def test_aggregated_queue_moves_by_predicted_ttft_in_tokens(rig_of: Callable[..., Rig]
                                                                  ) -> None:
    """Whole requests on aggregated workers: two streams on a1, the first running (it
    answered), the second queued behind it; a2 joins and takes the queued one (its prompt
    ahead of it on a1 makes the move pay); the running one stays."""
    rig = rig_of(a1=[Script(EVENTS[:1], hang=True), HUNG], a2=[Script(EVENTS)])
    rig.cluster.records = [record("a1", "aggregated")]
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "stream": True}

    async def whole(request_id: str) -> asyncio.Task[bytes]:
        route = RouteRequest(request_id=request_id, model="tiny",
                             prompt_token_ids=tuple(range(40)))
        response = await rig.proxy.decode(COMPLETIONS, body, None, route, {}, stream=True,
                                          clock=PhaseClock.start(request_id),
                                          role="aggregated")
        return asyncio.create_task(play(response))

    running = await whole("r-1")
    queued = await whole("r-2")
    async with asyncio.timeout(5):  # r-1 answered, r-2 waits
        while [w.route.request_id for w in rig.proxy.waiting.on("a1")] != ["r-2"]:
            await asyncio.sleep(0.01)
    rig.cluster.records.append(record("a2", "aggregated"))
    rig.proxy.reported_loads = lambda: {"a1": load(1, 1), "a2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 1
    assert '"text":"c"' in (await asyncio.wait_for(queued, 5)).decode()
    assert rig.workers.calls == ["a1", "a1", "a2"]
    assert redispatches(rig, "aggregated") == 1
    assert rig.tracker.in_flight("a1") == 1  # the running one is still there
    running.cancel()


async def test_an_aggregated_request_alone_does_not_move(rig_of: Callable[..., Rig]) -> None:
    """Control: the same queued request with nothing of the router's ahead of it on a1 gains
    nothing by moving (the model counts no work ahead), so it stays."""
    rig = rig_of(a1=[HUNG], a2=[Script(EVENTS)])
    rig.cluster.records = [record("a1", "aggregated")]
    route = RouteRequest(request_id="r-1", model="tiny", prompt_token_ids=tuple(range(40)))
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "stream": True}
    response = await rig.proxy.decode(COMPLETIONS, body, None, route, {}, stream=True,
                                      clock=PhaseClock.start("r-1"), role="aggregated")
    client = asyncio.create_task(play(response))
    await waiting_on(rig, "a1")
    rig.cluster.records.append(record("a2", "aggregated"))
    rig.proxy.reported_loads = lambda: {"a1": load(0, 1), "a2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 0
    assert rig.workers.calls == ["a1"]
    client.cancel()


def test_queued_now_is_the_newest_waiting_of_those_sent_before_the_scrape() -> None:
    route = RouteRequest(request_id="x", model="m")
    entries = [Waiting(route, "decode", "w", float(t), lambda worker: True) for t in range(5)]
    at_3_5 = WorkerLoad(running=1, waiting=2, kv_usage=0.0, scraped_at_s=3.5)
    assert queued_now(entries, at_3_5) == entries[2:4]
    assert queued_now(entries, WorkerLoad(1, 9, 0.0, scraped_at_s=3.5)) == entries[:4]
    assert queued_now(entries, WorkerLoad(1, 0, 0.0, scraped_at_s=3.5)) == []
    assert queued_now(entries, None) == []


def test_waiting_requests_forget_empty_workers() -> None:
    waiting = WaitingRequests()
    a = Waiting(RouteRequest(request_id="a", model="m"), "decode", "w", 0.0, lambda w: True)
    waiting.add(a)
    assert waiting.workers() == ["w"] and waiting.on("w") == [a]
    waiting.discard(a)
    waiting.discard(a)
    assert waiting.workers() == []


@pytest.mark.parametrize(("leaves", "calls"), [(True, ["d1", "d2"]), (False, ["d1"])])
async def test_a_stream_waiting_on_a_draining_worker_is_sent_elsewhere(
        rig_of: Callable[..., Rig], leaves: bool, calls: list[str]) -> None:
    """Scale-down without waiting (issue 25 item 3): d1 leaves routing while a stream still
    waits on it for its first output; the stream is sent again to d2 at once instead of
    holding d1's drain until d1 has served it. Control: d1 stays, and so does the stream."""
    rig = rig_of(p1=[], d1=[HUNG], d2=[Script(EVENTS)])
    client = await start_stream(rig)
    if leaves:
        rig.cluster.leave("d1")
    await asyncio.sleep(0.6)  # past two of the stream's looks at its worker
    assert rig.workers.calls == calls
    if leaves:
        assert '"text":"c"' in (await asyncio.wait_for(client, 5)).decode()
        assert rig.workers.streams[0].closed and "kv_transfer_params" not in rig.workers.bodies[1]
        assert not rig.tracker.recently_failed("d1") and rig.in_flight() == {}
    else:
        client.cancel()


async def test_a_queued_prefill_hop_moves_to_a_prefill_worker_that_joined(
        rig_of: Callable[..., Rig]) -> None:
    """The P/D prefill hop (answered whole, no stream) waits in ``PDProxy.watched``: queued on
    p1 behind work the router booked there, it moves to p2 when p2 joins, as the same attempt
    (no retry counted)."""
    rig = rig_of(p1=[relay.HANG], p2=[{"kv_transfer_params": relay.kv_of("p2")}], d1=[])
    p2 = next(r for r in rig.cluster.records if r.worker_id == "p2")
    rig.cluster.records.remove(p2)
    rig.tracker.start("p1", "running-there", 100, prefill=True)  # work ahead of it on p1
    hop = asyncio.create_task(relay.prefill(rig))
    await waiting_on(rig, "p1")
    rig.cluster.records.append(p2)
    rig.proxy.reported_loads = lambda: {"p1": load(1, 1), "p2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 1
    params, worker, _ = await asyncio.wait_for(hop, 5)
    assert worker.worker_id == "p2" and params == relay.kv_of("p2")
    assert rig.workers.calls == ["p1", "p2"]
    assert "kv_transfer_params" in rig.workers.bodies[1]  # asked to lease, as on p1
    assert redispatches(rig, "prefill") == 1 and rig.retries("prefill") == 0
    rig.tracker.finish("p1", "running-there")
    assert rig.in_flight() == {} and rig.proxy.waiting.workers() == []


async def test_a_queued_prefill_hop_with_nothing_ahead_stays(rig_of: Callable[..., Rig]) -> None:
    """Control: the same hop with no work of the router's ahead of it gains nothing by moving."""
    rig = rig_of(p1=[relay.HANG], p2=[{"kv_transfer_params": relay.kv_of("p2")}], d1=[])
    p2 = next(r for r in rig.cluster.records if r.worker_id == "p2")
    rig.cluster.records.remove(p2)
    hop = asyncio.create_task(relay.prefill(rig))
    await waiting_on(rig, "p1")
    rig.cluster.records.append(p2)
    rig.proxy.reported_loads = lambda: {"p1": load(0, 1), "p2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 0
    await asyncio.sleep(0.3)
    assert rig.workers.calls == ["p1"]
    hop.cancel()


async def test_a_queued_whole_answer_moves_without_the_prefills_params(
        rig_of: Callable[..., Rig]) -> None:
    """A non-streamed decode carrying the prefill's params, queued on d1: it moves to d2, which
    gets no params (d1 may free them on its abort) and computes the prompt; the router does
    not release the lease itself (d1 got the params: its abort frees them)."""
    answer = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 3}}
    rig = rig_of(p1=[], d1=[relay.HANG], d2=[answer])
    d2 = next(r for r in rig.cluster.records if r.worker_id == "d2")
    rig.cluster.records.remove(d2)
    whole = asyncio.create_task(decode(rig, stream=False))
    await waiting_on(rig, "d1")
    rig.cluster.records.append(d2)
    rig.proxy.reported_loads = lambda: {"d1": load(2, 1), "d2": load(0, 0)}
    assert Redispatcher(rig.proxy, 1.0, 1e-4).step() == 1
    response = await asyncio.wait_for(whole, 5)
    assert json.loads(bytes(response.body)) == answer
    assert rig.workers.calls == ["d1", "d2"]  # no release call either
    assert "kv_transfer_params" in rig.workers.bodies[0]
    assert "kv_transfer_params" not in rig.workers.bodies[1]
    assert redispatches(rig, "decode") == 1 and rig.retries("decode") == 0
    assert rig.in_flight() == {} and rig.proxy.waiting.workers() == []
