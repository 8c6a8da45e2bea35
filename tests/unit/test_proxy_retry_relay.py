"""The proxy's retries, SSE relay and placement bookkeeping, through its seams, in-process.

:class:`PDProxy` is built as the router builds it, with an in-memory ``ClusterSource`` and an
``httpx.AsyncClient`` whose transport (``httpx.MockTransport``) plays the workers: each call
takes the next scripted behaviour of the worker it reached (an answer, a status, an SSE stream
that may break, or the httpx error a dead or stale connection raises). Streamed answers are
played through the ASGI interface, as uvicorn would send them, by a client that may hang up.
No uvicorn, no Redis, no sockets.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Message, Scope

from kvtransfer.protocol import Handshake
from router.api.first_token import FirstToken
from router.api.proxy import PDProxy
from router.api.redispatch import Redispatch, Waiting
from router.api.schemas import COMPLETIONS
from router.api.timeline import PhaseClock
from router.config import RouterSettings
from router.errors import UpstreamError
from router.metrics import RouterMetrics
from router.placement import Placement
from router.policy.base import RouteRequest
from router.policy.context import PolicyContext
from router.samples import parse_samples, total
from router.state.cluster import JoinListener
from router.state.load import LoadTracker
from router.state.registry import WorkerRecord

MODEL = "tiny"

def kv_of(worker_id: str) -> dict[str, Any]:
    """The params prefill ``worker_id`` answers: its own engine and registered UCX address."""
    engine = f"engine-{worker_id}"
    return {"remote_engine_id": engine, "remote_block_ids": [1, 2], "remote_request_id": "r",
            "remote_handshake": Handshake(engine, worker_id.encode(), (), "c").to_wire()}


KV = kv_of("p1")
BODY: dict[str, Any] = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": True}
EVENTS = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n',
          b'data: {"choices":[{"index":0,"text":"b"}]}\n\n',
          b'data: {"choices":[{"index":0,"text":"c","finish_reason":"length"}]}\n\n',
          b"data: [DONE]\n\n"]
STALE = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""What a keep-alive connection the worker closed as it was reused raises (router.api.upstream):
the only errors retried on the same worker."""


# ---- the seams: an in-memory cluster and scripted workers behind httpx.MockTransport --------

class MemoryCluster:
    """A ``ClusterSource`` over a list of records; ``evict`` drops a worker, as ClusterView."""

    def __init__(self, records: list[WorkerRecord]) -> None:
        self.records = records
        self.evicted: list[str] = []
        self.left: set[str] = set()
        self.listeners: list[JoinListener] = []

    @property
    def redis_ok(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return [r for r in self.records
                if (role is None or r.role == role) and (model is None or r.model == model)]

    def models(self) -> list[str]:
        return sorted({r.model for r in self.records})

    def evict(self, worker_id: str) -> None:
        self.evicted.append(worker_id)
        self.records = [r for r in self.records if r.worker_id != worker_id]

    def leaving(self, worker_id: str) -> bool:
        return worker_id in self.left

    def on_join(self, listener: JoinListener) -> None:
        self.listeners.append(listener)

    def join(self, record: WorkerRecord) -> None:
        """A worker joins, the listeners told in the same update (as ClusterView does)."""
        self.records.append(record)
        for listener in self.listeners:
            listener([record])

    def leave(self, worker_id: str) -> None:
        """The worker drains (the registry's draining set): out of routing, streams move."""
        self.left.add(worker_id)
        self.records = [r for r in self.records if r.worker_id != worker_id]


class Script:
    """A broken (or complete) SSE body: ``chunks``, then ``error`` raised if given, or silence
    (``hang``: a stopped worker)."""

    def __init__(self, chunks: list[bytes],
                 error: type[httpx.TransportError] | None = None, hang: bool = False) -> None:
        self.chunks = chunks
        self.error = error
        self.hang = hang


class ScriptedStream(httpx.AsyncByteStream):
    """An upstream body that yields its chunks, may fail like a dropped connection, and
    remembers whether the proxy closed it."""

    def __init__(self, script: Script, request: httpx.Request) -> None:
        self.script = script
        self.request = request
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.script.chunks:
            yield chunk
            await asyncio.sleep(0)  # the next event comes later, as from an engine
        if self.script.hang:
            await asyncio.Event().wait()
        if self.script.error is not None:
            raise self.script.error("connection dropped mid-stream", request=self.request)

    async def aclose(self) -> None:
        self.closed = True


HANG = "hang"
Behaviour = type[httpx.TransportError] | int | dict[str, Any] | Script | str
"""An httpx error class (raised at the call), a status code (an error body), a JSON answer,
an SSE stream, or ``HANG`` (no answer at all)."""


@dataclass
class Workers:
    """Scripted workers, by worker id (the URL host); records every call."""

    scripts: dict[str, list[Behaviour]]
    calls: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    streams: list[ScriptedStream] = field(default_factory=list)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        worker = request.url.host
        self.calls.append(worker)
        self.bodies.append(json.loads(request.content))
        step = self.scripts[worker].pop(0)
        if step == HANG:  # a stopped worker: the connection is accepted, nothing comes back
            await asyncio.Event().wait()
        if isinstance(step, type):
            raise step(f"{worker}: scripted failure", request=request)
        if isinstance(step, int):
            return httpx.Response(step, json={"error": {"message": "scripted"}})
        if isinstance(step, Script):
            stream = ScriptedStream(step, request)
            self.streams.append(stream)
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=stream)
        return httpx.Response(200, json=step)


def record(worker_id: str, role: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role,  # type: ignore[arg-type]
                        model=MODEL, model_path="/nonexistent", http_url=f"http://{worker_id}",
                        engine_id=f"engine-{worker_id}",
                        ucx_address=base64.b64encode(worker_id.encode()).decode(),
                        max_model_len=4096,
                        started_at=0.0)


@dataclass
class Rig:
    proxy: PDProxy
    cluster: MemoryCluster
    workers: Workers
    tracker: LoadTracker
    metrics: RouterMetrics

    def in_flight(self) -> dict[str, int]:
        """Requests booked and not yet ended: per worker (the placement ledger) and per role
        (the router's gauge), nonzero entries only."""
        samples = parse_samples(self.metrics.render().decode())
        per_worker = {w: self.tracker.in_flight(w) for w in self.workers.scripts}
        per_role = {f"role:{r}": int(total(samples, "pdserve_router_in_flight_requests", role=r))
                    for r in ("prefill", "decode")}
        return {k: v for k, v in {**per_worker, **per_role}.items() if v}

    def retries(self, role: str) -> float:
        return total(parse_samples(self.metrics.render().decode()),
                     "pdserve_router_upstream_retries_total", role=role)


@pytest.fixture
async def rig_of() -> AsyncIterator[Callable[..., Rig]]:
    """Builds a proxy over ``prefill`` and ``decode`` workers with the given scripts."""
    clients: list[httpx.AsyncClient] = []

    def build(overrides: dict[str, Any] | None = None,
              unresponsive: Callable[[str], bool] = lambda worker_id: False,
              **scripts: list[Behaviour]) -> Rig:
        settings = RouterSettings(**{"policy": "round_robin", "decode_policy": "round_robin",
                                     "prefill_retries": 2, "decode_retries": 2,
                                     "no_worker_wait_s": 0.0, **(overrides or {})})
        records = [record(w, "prefill" if w.startswith("p") else "decode") for w in scripts]
        workers = Workers(dict(scripts))
        client = httpx.AsyncClient(transport=httpx.MockTransport(workers.handle))
        clients.append(client)
        tracker, metrics = LoadTracker(), RouterMetrics()
        placement = Placement.create(settings.policy, settings.decode_policy, PolicyContext(),
                                     tracker)
        cluster = MemoryCluster(records)
        proxy = PDProxy(settings, cluster, metrics, placement, tracker, client,
                        unresponsive=unresponsive)
        return Rig(proxy, cluster, workers, tracker, metrics)

    yield build
    for client in clients:
        await client.aclose()


def route(request_id: str = "req-1") -> tuple[RouteRequest, PhaseClock]:
    return RouteRequest(request_id=request_id, model=MODEL, prompt_token_ids=(1, 2, 3)), \
        PhaseClock.start(request_id)


async def prefill(rig: Rig) -> Any:
    request, clock = route()
    return await rig.proxy.prefill(COMPLETIONS, BODY, request, {}, clock)


async def decode(rig: Rig, *, stream: bool, request_id: str = "req-1") -> Response:
    request, clock = route(request_id)
    return await rig.proxy.decode(COMPLETIONS, BODY, KV, request, {}, stream=stream,
                                  clock=clock)


async def play(response: Response, *, hang_up_after: int | None = None,
               on_chunk: Callable[[], None] = lambda: None) -> bytes:
    """Send ``response`` through ASGI (spec 2.4, as uvicorn) to a client that receives the
    body, or hangs up once ``hang_up_after`` body chunks arrived; returns what it received."""
    received: list[bytes] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] != "http.response.body":
            return
        if hang_up_after is not None and len(received) == hang_up_after:
            raise OSError("client went away")
        if message.get("body"):
            received.append(message["body"])
            on_chunk()

    scope: Scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
    await response(scope, receive, send)
    return b"".join(received)


# ---- (a) retries ---------------------------------------------------------------------------

@pytest.mark.parametrize("error", STALE)
async def test_prefill_stale_connection_is_retried_once_on_the_same_worker(
        rig_of: Callable[..., Rig], error: type[httpx.TransportError]) -> None:
    rig = rig_of(p1=[error, {"kv_transfer_params": KV}], d1=[])
    params, worker, _ = await prefill(rig)
    assert rig.workers.calls == ["p1", "p1"]
    assert worker.worker_id == "p1" and params == KV
    assert rig.retries("prefill") == 1 and rig.cluster.evicted == []
    assert rig.in_flight() == {}


async def test_same_worker_retry_happens_only_once(rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(p1=[httpx.ReadError, httpx.ReadError, {"kv_transfer_params": KV}], d1=[])
    with pytest.raises(UpstreamError) as raised:
        await prefill(rig)
    assert rig.workers.calls == ["p1", "p1"]  # the third answer is never asked for
    assert raised.value.kind == "protocol" and raised.value.status == 502
    assert rig.in_flight() == {}


@pytest.mark.parametrize(("error", "kind", "status"), [
    (httpx.ConnectError, "connect", 502),
    (httpx.ConnectTimeout, "timeout", 504),
    (httpx.ReadTimeout, "timeout", 504),
    (500, "status", 502),
])
async def test_other_failures_are_not_retried_on_the_same_worker(
        rig_of: Callable[..., Rig], error: Behaviour, kind: str, status: int) -> None:
    """Negative control: a dead, slow or failing worker is not asked again (one worker: the
    request fails with the mapped error after one call)."""
    rig = rig_of(p1=[error, {"kv_transfer_params": KV}], d1=[])
    with pytest.raises(UpstreamError) as raised:
        await prefill(rig)
    assert rig.workers.calls == ["p1"]
    assert (raised.value.kind, raised.value.status) == (kind, status)
    assert rig.retries("prefill") == 0
    # nobody listened: out of routing (a timeout or a 5xx keeps the worker in the rings)
    assert rig.cluster.evicted == (["p1"] if kind == "connect" else [])
    assert rig.in_flight() == {}


async def test_connect_failure_evicts_and_moves_to_another_worker(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(p1=[httpx.ConnectError], p2=[{"kv_transfer_params": kv_of("p2")}], d1=[])
    _, worker, _ = await prefill(rig)
    assert rig.workers.calls == ["p1", "p2"] and worker.worker_id == "p2"
    assert rig.cluster.evicted == ["p1"]
    assert rig.in_flight() == {}


@pytest.mark.parametrize("error", STALE)
async def test_decode_stale_connection_is_retried_on_the_same_worker(
        rig_of: Callable[..., Rig], error: type[httpx.TransportError]) -> None:
    answer = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 3}}
    rig = rig_of(p1=[], d1=[error, answer])
    response = await decode(rig, stream=False)
    assert response.status_code == 200 and json.loads(bytes(response.body)) == answer
    assert rig.workers.calls == ["d1", "d1"] and rig.retries("decode") == 1
    assert rig.in_flight() == {}


async def test_decode_connect_failure_is_not_retried_on_the_same_worker(
        rig_of: Callable[..., Rig]) -> None:
    """The lone decode refused the connection: not asked again; with its pool empty, the
    prefill worker (a complete engine) serves the request whole, without the params."""
    rig = rig_of(p1=[Script(EVENTS)], d1=[httpx.ConnectError, Script(EVENTS)])
    body = await play(await decode(rig, stream=True))
    assert body == b"".join(EVENTS)
    assert rig.workers.calls == ["d1", "p1"]
    assert "kv_transfer_params" not in rig.workers.bodies[1]
    assert rig.in_flight() == {}


async def test_with_no_engine_left_the_decode_failure_is_the_answer(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(d1=[httpx.ConnectError, Script(EVENTS)])
    with pytest.raises(UpstreamError) as raised:
        await decode(rig, stream=True)
    assert rig.workers.calls == ["d1"] and raised.value.kind == "connect"
    assert rig.in_flight() == {}


# ---- (b) the SSE relay ---------------------------------------------------------------------

async def test_stream_is_relayed_in_order_and_ends_with_done(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(p1=[], d1=[Script(EVENTS)])
    response = await decode(rig, stream=True)
    booked: list[dict[str, int]] = []
    body = await play(response, on_chunk=lambda: booked.append(rig.in_flight()))
    assert body == b"".join(EVENTS) and body.endswith(b"data: [DONE]\n\n")
    # booked while it streamed (not vacuous: at least one chunk), released once it ended;
    # what arrived together may be relayed together
    assert booked and booked == [{"d1": 1, "role:decode": 1}] * len(booked)
    assert rig.in_flight() == {} and rig.workers.streams[0].closed


@pytest.mark.parametrize("error", [httpx.ReadError, httpx.RemoteProtocolError,
                                   httpx.ReadTimeout])
async def test_upstream_failure_mid_stream_becomes_one_error_event(
        rig_of: Callable[..., Rig], error: type[httpx.TransportError]) -> None:
    """A worker that sent no token ids (EVENTS have none): what the client has cannot be
    continued elsewhere, so the stream ends with one error event."""
    rig = rig_of(p1=[], d1=[Script(EVENTS[:2], error), Script(EVENTS)])
    response = await decode(rig, stream=True)
    body = await play(response)
    head, tail = body[:len(b"".join(EVENTS[:2]))], body[len(b"".join(EVENTS[:2])):]
    assert head == b"".join(EVENTS[:2])  # what was relayed stays, in order
    events = [e for e in tail.split(b"\n\n") if e]
    assert len(events) == 3 and events[2] == b"data: [DONE]"
    # review finding 18: the open choice ends ("abort", as vLLM ends an aborted request)
    # before the error event, for clients that read only the choices
    finish = json.loads(events[0].removeprefix(b"data: "))
    assert finish["object"] == "text_completion" and finish["model"] == MODEL
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                  "finish_reason": "abort", "stop_reason": None}]
    err = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert err["type"] == "upstream_error" and err["code"] == "upstream_stream_error"
    assert err["param"] is None and "decode failed mid-stream" in err["message"]
    # bytes reached the client: no retry, not even a stale-connection one on the same worker
    assert rig.workers.calls == ["d1"] and rig.retries("decode") == 0
    assert rig.in_flight() == {}


async def test_failure_before_the_first_byte_is_retried_not_relayed(
        rig_of: Callable[..., Rig]) -> None:
    """Control of the above: with nothing relayed yet the stream is retried (stale: on the same
    worker), and the client sees one clean stream."""
    rig = rig_of(p1=[], d1=[Script([], httpx.ReadError), Script(EVENTS)])
    body = await play(await decode(rig, stream=True))
    assert body == b"".join(EVENTS)
    assert rig.workers.calls == ["d1", "d1"] and rig.retries("decode") == 1
    assert rig.in_flight() == {}


@pytest.mark.parametrize("foreign", [
    kv_of("p2"),  # another engine's params
    {**kv_of("p1"), "remote_handshake": kv_of("p2")["remote_handshake"]},  # another address
    {**kv_of("p1"), "remote_handshake": "not-a-handshake"},
])
async def test_params_not_the_prefills_own_are_never_signed(
        rig_of: Callable[..., Rig], foreign: dict[str, Any]) -> None:
    """Review finding 5: the router signs only params naming the chosen prefill's registered
    engine and UCX address; others count as that prefill failing (the next one is asked)."""
    rig = rig_of(p1=[{"kv_transfer_params": foreign}], p2=[{"kv_transfer_params": kv_of("p2")}],
                 d1=[])
    params, worker, _ = await prefill(rig)
    assert worker.worker_id == "p2" and params == kv_of("p2")
    assert total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_upstream_errors_total", kind="foreign_kv_params") == 1


# ---- (b2) a decode that may have pulled: its retry carries no kv_transfer_params ----------

def withdrawn(rig: Rig) -> float:
    return total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_kv_params_withdrawn_total")


@pytest.mark.parametrize("failure", [500, httpx.ReadTimeout, httpx.ReadError,
                                     httpx.RemoteProtocolError])
async def test_a_decode_that_may_have_pulled_is_retried_without_the_params(
        rig_of: Callable[..., Rig], failure: Behaviour) -> None:
    """Review finding 2: the failed decode may have pulled and released the prefill's lease,
    whose blocks may hold another request's KV by now; the retry computes the prompt."""
    answer = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 3}}
    rig = rig_of(p1=[], d1=[failure, answer], d2=[answer])
    response = await decode(rig, stream=False)
    assert response.status_code == 200
    first, retry = rig.workers.bodies
    assert first["kv_transfer_params"] == KV
    assert "kv_transfer_params" not in retry
    assert withdrawn(rig) == 1 and rig.retries("decode") == 1
    assert rig.in_flight() == {}


async def test_every_retry_after_a_reached_decode_goes_without_the_params(
        rig_of: Callable[..., Rig]) -> None:
    """Once spent, the params stay spent (a connect failure after it does not bring them
    back), and each retry sent without them is counted, as on the first-token path."""
    answer = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 3}}
    rig = rig_of(p1=[], d1=[500], d2=[httpx.ConnectError], d3=[answer])
    response = await decode(rig, stream=False)
    assert response.status_code == 200
    assert [("kv_transfer_params" in b) for b in rig.workers.bodies] == [True, False, False]
    assert withdrawn(rig) == 2 and rig.retries("decode") == 2


async def test_a_decode_never_reached_is_retried_with_the_params(
        rig_of: Callable[..., Rig]) -> None:
    """Negative control: connect refused means nothing reached that decode: the params are
    still unspent and the retry pulls."""
    answer = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 3}}
    rig = rig_of(p1=[], d1=[httpx.ConnectError], d2=[answer])
    await decode(rig, stream=False)
    assert [b["kv_transfer_params"] for b in rig.workers.bodies] == [KV, KV]
    assert withdrawn(rig) == 0 and rig.retries("decode") == 1


async def test_a_continued_stream_retries_without_the_params_once_a_decode_was_reached(
        rig_of: Callable[..., Rig]) -> None:
    """The first-token path: the same rule for the continuation's decode."""
    first = FirstToken("cmpl-1", 0, MODEL, "x", 7, (1, 2, 3))
    rig = rig_of(p1=[], d1=[500], d2=[httpx.ConnectError], d3=[Script(EVENTS)])
    request, clock = route()
    body = await play(rig.proxy.continue_stream(COMPLETIONS, BODY, first, KV, request, {},
                                                clock))
    assert body.endswith(b"data: [DONE]\n\n") and b"error" not in body
    assert b"abort" not in body  # control of the failed stream below: a normal finish
    assert [("kv_transfer_params" in b) for b in rig.workers.bodies] == [True, False, False]
    assert rig.workers.bodies[2]["prompt"] == [1, 2, 3, 7]  # the prompt is computed there
    assert withdrawn(rig) == 2
    assert total(parse_samples(rig.metrics.render().decode()), "pdserve_router_requests_total",
                 status="200") == 1


async def test_a_continued_stream_whose_decodes_all_fail_is_counted_as_failed(
        rig_of: Callable[..., Rig]) -> None:
    """Review finding 18: the client saw a 200 and an error event; the request metrics and the
    timeline record the failure (502), not a success. Control: the stream test above, whose
    decode answers, is counted as 200."""
    first = FirstToken("cmpl-1", 0, MODEL, "x", 7, (1, 2, 3))
    rig = rig_of(p1=[], d1=[500], d2=[500], d3=[500])
    request, clock = route()
    body = await play(rig.proxy.continue_stream(COMPLETIONS, BODY, first, KV, request, {},
                                                clock))
    assert b"upstream_stream_error" in body
    # the client saw the prefill's token, then its choice finished "abort", then the error
    # event, then [DONE] (row 18: a client reading only choices sees it did not end normally)
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    *answer, finish, error = (json.loads(e) for e in events[:-1])
    assert error["error"]["code"] == "upstream_stream_error"
    assert [c["finish_reason"] for c in finish["choices"]] == ["abort"]
    assert finish["id"] == "cmpl-1" and finish["choices"][0]["text"] == ""
    assert [c["text"] for e in answer for c in e["choices"]] == ["x"]
    assert all(c["finish_reason"] is None for e in answer for c in e["choices"])
    samples = parse_samples(rig.metrics.render().decode())
    assert total(samples, "pdserve_router_requests_total", status="502") == 1
    assert total(samples, "pdserve_router_requests_total", status="200") == 0
    assert rig.in_flight() == {}


# ---- (c) bookkeeping after a client hang-up ------------------------------------------------

async def test_client_hang_up_ends_the_booking_and_closes_upstream(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(p1=[], d1=[Script(EVENTS)])
    response = await decode(rig, stream=True)
    with pytest.raises(ClientDisconnect):
        await play(response, hang_up_after=1)
    assert rig.in_flight() == {}
    assert rig.workers.streams[0].closed


async def test_hang_up_before_the_body_still_ends_the_booking(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(p1=[], d1=[Script(EVENTS)])
    response = await decode(rig, stream=True)
    assert rig.in_flight() == {"d1": 1, "role:decode": 1}  # booked until the relay ends
    with pytest.raises(ClientDisconnect):
        await play(response, hang_up_after=0)
    assert rig.in_flight() == {}
    assert rig.workers.streams[0].closed


# ---- (d) streams that move (router.api.resume) ---------------------------------------------

def ids_event(text: str, ids: list[int], finish: str | None = None,
              prompt: list[int] | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids,
              "prompt_token_ids": prompt}
    return b"data: " + json.dumps({"id": "cmpl-x", "choices": [choice]}).encode() + b"\n\n"


ID_EVENTS = [ids_event("a", [10], prompt=[1, 2, 3]), ids_event("b", [11]),
             ids_event("c", [12]), ids_event("d", [13], "length"), b"data: [DONE]\n\n"]
MOVED = [ids_event("c", [12], prompt=[1, 2, 3, 10, 11]), ids_event("d", [13], "length"),
         b"data: [DONE]\n\n"]


def texts(body: bytes) -> str:
    out = ""
    for part in body.split(b"\n\n"):
        if part.startswith(b"data: {"):
            event = json.loads(part[6:])
            assert "error" not in event, event
            out += "".join(c["text"] for c in event["choices"])
    return out


def moves(rig: Rig) -> float:
    return total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_migrations_total")


@pytest.mark.parametrize("error", [httpx.ReadError, httpx.RemoteProtocolError,
                                   httpx.ReadTimeout])
async def test_a_stream_whose_worker_fails_mid_stream_moves_to_another(
        rig_of: Callable[..., Rig], error: type[httpx.TransportError]) -> None:
    rig = rig_of(p1=[], d1=[Script(ID_EVENTS[:2], error)], d2=[Script(MOVED)])
    body = await play(await decode(rig, stream=True))
    assert texts(body) == "abcd" and body.endswith(b"data: [DONE]\n\n")
    assert body.count(b"[DONE]") == 1 and b'"token_ids":[' not in body  # ids stay here
    first, moved = rig.workers.bodies
    assert first["return_token_ids"] is True and first["kv_transfer_params"] == KV
    assert moved["prompt"] == [1, 2, 3, 10, 11] and moved["max_tokens"] == 2
    assert "kv_transfer_params" not in moved  # d1 may have pulled: never sent again
    assert moves(rig) == 1 and rig.in_flight() == {}
    assert all(stream.closed for stream in rig.workers.streams)


async def test_a_stream_that_goes_silent_moves_after_the_stall_bound(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of({"stall_timeout_s": 0.05}, p1=[], d1=[Script(ID_EVENTS[:2], hang=True)],
                 d2=[Script(MOVED)])
    body = await play(await decode(rig, stream=True))
    assert texts(body) == "abcd" and rig.workers.calls == ["d1", "d2"]
    assert total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_migrations_total", reason="stall") == 1
    assert rig.in_flight() == {} and rig.workers.streams[0].closed  # d1's request aborted


async def test_a_stream_waiting_on_a_worker_that_stopped_answering_is_sent_elsewhere(
        rig_of: Callable[..., Rig]) -> None:
    """Before any output the stall bound does not apply (a long queue is not a fault); a
    worker failing its load probes is. Nothing was known of the prompt's ids yet, so the
    request itself is sent again."""
    rig = rig_of({"stall_timeout_s": 0.05}, unresponsive=lambda worker_id: worker_id == "d1",
                 p1=[], d1=[Script([], hang=True)], d2=[Script(ID_EVENTS)])
    body = await play(await decode(rig, stream=True))
    assert texts(body) == "abcd" and rig.workers.calls == ["d1", "d2"]
    assert rig.workers.bodies[1]["prompt"] == BODY["prompt"]  # the request as it was
    assert moves(rig) == 0 and rig.retries("decode") == 1  # nothing had reached the client
    assert rig.in_flight() == {}


async def test_a_slow_but_answering_worker_keeps_its_waiting_stream(
        rig_of: Callable[..., Rig]) -> None:
    """Negative control of the above: the same silence from a worker that answers its probes
    is waited for (here until the test gives up), never sent elsewhere."""
    rig = rig_of({"stall_timeout_s": 0.05}, p1=[], d1=[Script([], hang=True)],
                 d2=[Script(ID_EVENTS)])
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(play(await decode(rig, stream=True)), timeout=0.5)
    assert rig.workers.calls == ["d1"]


async def test_moves_stop_at_the_limit(rig_of: Callable[..., Rig]) -> None:
    rig = rig_of({"migration_limit": 1}, p1=[], d1=[Script(ID_EVENTS[:2], httpx.ReadError)],
                 d2=[Script(MOVED[:1], httpx.ReadError)], d3=[Script(MOVED)])
    body = await play(await decode(rig, stream=True))
    assert b"upstream_stream_error" in body and rig.workers.calls == ["d1", "d2"]
    assert moves(rig) == 1 and rig.in_flight() == {}
    assert total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_migrations_refused_total", reason="limit") == 1


async def test_a_prefill_waiting_on_a_stopped_worker_goes_to_the_next(
        rig_of: Callable[..., Rig]) -> None:
    """Issue 23 item 3: p1 accepted the request and stopped (SIGSTOP); once it fails its load
    probes the prefill is asked of p2. Control: p1 answering its probes is waited for."""
    rig = rig_of(unresponsive=lambda worker_id: worker_id == "p1",
                 p1=[HANG], p2=[{"kv_transfer_params": kv_of("p2")}], d1=[])
    params, worker, _ = await prefill(rig)
    assert worker.worker_id == "p2" and params == kv_of("p2")
    assert total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_upstream_errors_total", role="prefill", kind="stall") == 1
    assert rig.in_flight() == {}
    control = rig_of(p1=[HANG], p2=[{"kv_transfer_params": kv_of("p2")}], d1=[])
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(prefill(control), timeout=0.5)
    assert control.workers.calls == ["p1"]


async def test_a_whole_answer_waiting_on_a_stopped_decode_is_served_elsewhere(
        rig_of: Callable[..., Rig]) -> None:
    answer = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 3}}
    rig = rig_of(unresponsive=lambda worker_id: worker_id == "d1", p1=[answer], d1=[HANG])
    response = await decode(rig, stream=False)
    assert json.loads(bytes(response.body)) == answer
    assert rig.workers.calls == ["d1", "p1"]  # the only other engine, whole
    assert "kv_transfer_params" not in rig.workers.bodies[1]
    assert rig.in_flight() == {}


@pytest.mark.parametrize(("limit", "served_by"), [(3, ["d1", "d2"]), (0, ["d1"])])
async def test_a_stream_on_a_draining_worker_moves_at_its_next_event(
        rig_of: Callable[..., Rig], limit: int, served_by: list[str]) -> None:
    """Issue 23 item 4: d1 leaves routing (a drain, a SIGTERM) after the client got "b": the
    stream goes on on d2 at once instead of holding d1's drain until it ends. d1 did nothing
    wrong: it is not marked failed. Control: with moves off it finishes on d1."""
    on_d1 = [ids_event("b", [11], prompt=[1, 2, 3, 10]), ids_event("c", [12]),
             ids_event("d", [13], "length"), b"data: [DONE]\n\n"]
    rig = rig_of({"migration_limit": limit}, p1=[], d1=[Script(on_d1)], d2=[Script(MOVED)])
    request, clock = route()
    first = FirstToken("cmpl-x", 0, MODEL, "a", 10, (1, 2, 3))
    d1 = next(r for r in rig.cluster.records if r.worker_id == "d1")
    response = rig.proxy.continue_stream(COMPLETIONS, BODY, first, KV, request, {}, clock,
                                         first_choice=d1)
    seen: list[int] = []

    def leave_after_b() -> None:
        seen.append(1)
        if len(seen) == 2:  # the head ("a"), then d1's first event ("b")
            rig.cluster.leave("d1")

    body = await play(response, on_chunk=leave_after_b)
    assert texts(body) == "abcd"
    assert rig.workers.calls == served_by
    assert total(parse_samples(rig.metrics.render().decode()),
                 "pdserve_router_migrations_total", reason="drain") == (limit > 0)
    assert rig.tracker.candidates([d1], {})[0].recently_failed is False
    assert rig.in_flight() == {}


# ---- (c) a call waited on: moved, stalled, or cancelled from outside -------------------------

class Call:
    """A worker call that answers only when told; remembers whether it was abandoned."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.cancelled = False

    async def run(self) -> httpx.Response:
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return httpx.Response(200)


def worker_of(rig: Rig, worker_id: str) -> WorkerRecord:
    return next(r for r in rig.cluster.records if r.worker_id == worker_id)


async def wait_on_d1(rig: Rig) -> tuple[Call, asyncio.Future[httpx.Response], Waiting]:
    """A call to d1 being waited on (registered for re-dispatch), and its waiting entry."""
    call, (request, _) = Call(), route()
    waited = asyncio.ensure_future(rig.proxy.watched(worker_of(rig, "d1"), "decode", call.run(),
                                                     request))
    await asyncio.sleep(0)
    [entry] = rig.proxy.waiting.on("d1")
    return call, waited, entry


async def test_a_move_stops_the_waiting_call_and_raises_redispatch(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of(d1=[], d2=[])
    call, waited, entry = await wait_on_d1(rig)
    assert entry.move_to(worker_of(rig, "d2")) is True
    with pytest.raises(Redispatch) as moved:
        await waited
    assert moved.value.target.worker_id == "d2" and call.cancelled  # abandoned, not awaited
    assert rig.proxy.waiting.on("d1") == []
    assert entry.move_to(worker_of(rig, "d2")) is False  # once


async def test_an_answered_call_is_returned_and_can_no_longer_move(
        rig_of: Callable[..., Rig]) -> None:
    """Control for the test above: the same wait, answered first, returns the answer."""
    rig = rig_of(d1=[], d2=[])
    call, waited, entry = await wait_on_d1(rig)
    call.answer.set()
    assert (await waited).status_code == 200 and not call.cancelled
    assert entry.move_to(worker_of(rig, "d2")) is False


async def test_a_worker_that_stops_answering_its_probes_fails_the_wait_as_a_stall(
        rig_of: Callable[..., Rig]) -> None:
    rig = rig_of({"stall_timeout_s": 5.0}, unresponsive=lambda worker_id: worker_id == "d1",
                 d1=[])
    call = Call()
    with pytest.raises(UpstreamError) as stalled:
        await rig.proxy.watched(worker_of(rig, "d1"), "decode", call.run())
    assert stalled.value.kind == "stall" and call.cancelled


async def test_a_cancel_from_outside_is_not_taken_for_a_move(rig_of: Callable[..., Rig]) -> None:
    """The client left (or the request's deadline passed) while the call waited: the wait
    ends cancelled, even when a move was asked in the same moment."""
    rig = rig_of(d1=[], d2=[])
    call, waited, entry = await wait_on_d1(rig)
    waited.cancel()
    entry.move_to(worker_of(rig, "d2"))
    with pytest.raises(asyncio.CancelledError):
        await waited
    assert call.cancelled and rig.proxy.waiting.on("d1") == []
