"""The real router under uvicorn, real Redis, fake workers: the P/D flow and its failures."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from router.api.app import create_app
from router.api.rewrite import HANDOFF_PRIORITY
from router.config import RouterSettings
from router.state.registry import WorkerRecord
from serve.redis_server import RedisServer, start_redis
from tests.fakes.fake_worker import DECODE_PIECES, FakeWorker, ServerThread
from tests.support.router import calls, deregister, register, stream_request, wait_metrics


def _upstream(prefill: FakeWorker) -> str:
    """The router's id of the first request ``prefill`` received (what it leased under)."""
    return prefill.requests[0].headers["x-request-id"]


def test_completion_two_step_flow_sends_rewritten_bodies(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0.0,
            "min_tokens": 2, "ignore_eos": True}
    resp = client.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "rid-1"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "rid-1"
    data = resp.json()
    assert data["choices"][0]["text"] == "".join(DECODE_PIECES)
    assert data["served_by"] == "d0"
    p0, d0 = fakes["p0"], fakes["d0"]
    assert calls(fakes) == {"p0": 1, "p1": 0, "d0": 1, "d1": 0}
    assert p0.requests[0].path == "/v1/completions"
    assert p0.requests[0].body == {
        "model": "tiny", "prompt": "hello world", "max_tokens": 1, "temperature": 0.0,
        "ignore_eos": True, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    upstream = p0.requests[0].headers["x-request-id"]
    assert upstream.startswith("rid-1.")  # the client's id, made unique (review finding 11)
    assert d0.requests[0].body == {**body, "kv_transfer_params": p0.kv_params(upstream),
                                   "priority": HANDOFF_PRIORITY}
    assert d0.requests[0].headers["x-request-id"] == upstream


def test_round_robin_and_least_loaded_spread(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    for _ in range(4):
        resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"].startswith("pd-")
    assert calls(fakes) == {"p0": 2, "p1": 2, "d0": 2, "d1": 2}
    rids = {f.requests[0].headers["x-request-id"] for f in fakes.values()}
    assert len(rids) == 2  # p0 and d0 saw the same first request; p1 and d1 the second


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_relay_is_byte_identical(
        chat: bool, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    path, body = stream_request(chat)
    with client.stream("POST", url + path, json=body, headers={"x-request-id": "s-1"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"] == "s-1"
        relayed = b"".join(resp.iter_raw())
    # The router asked for the ids (the stream can then move, router.api.resume) and relays
    # every event as the worker sent it, the ids nulled as in a plain answer.
    assert _events(relayed) == [_without_ids(e) for e in _events(fakes["d0"].sent[0])]
    assert b"token_ids\": [" in fakes["d0"].sent[0]  # control: the worker did send ids
    assert relayed.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' in relayed
    prefill = fakes["p0"].requests[0].body
    assert "stream_options" not in prefill and prefill["stream"] is False
    assert prefill["max_tokens"] == 1
    assert prefill.get("max_completion_tokens") == (1 if chat else None)
    pulled = fakes["p0"].kv_params(_upstream(fakes["p0"]))
    assert fakes["d0"].requests[0].body == {**body, "return_token_ids": True,
                                            "kv_transfer_params": pulled,
                                            "priority": HANDOFF_PRIORITY}

    endpoint = "chat_completions" if chat else "completions"
    # Stream accounting closes right after the last byte, possibly after the client has it.
    wait_metrics(client, url, [
        f'pdserve_router_ttft_seconds_count{{endpoint="{endpoint}",model_name="tiny"}} 1.0',
        f'pdserve_router_requests_total{{endpoint="{endpoint}",model_name="tiny",'
        'status="200"} 1.0',
        'pdserve_router_in_flight_requests{role="decode"} 0.0',
        'pdserve_router_in_flight_requests{role="prefill"} 0.0',
    ])


BAD_BODIES = [
    (b"{broken", 400, "invalid_json"),
    (json.dumps({"prompt": "x"}).encode(), 400, "missing_field"),
    (json.dumps({"model": "unknown", "prompt": "x"}).encode(), 404, "model_not_found"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 400,
     "invalid_value"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "five"}).encode(), 400,
     "invalid_type"),
    (json.dumps({"model": "tiny", "prompt": "x", "best_of": 3}).encode(), 400, "invalid_value"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), 400,
     "invalid_type"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(), 400,
     "invalid_value"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_p": 5}).encode(), 400, "invalid_value"),
    (json.dumps({"model": "tiny", "prompt": "hello world " * 40}).encode(), 400,
     "context_length_exceeded"),
]


def test_bad_requests_never_reach_workers(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    for content, status, code in BAD_BODIES:
        resp = client.post(url + "/v1/completions", content=content,
                           headers={"content-type": "application/json"})
        assert resp.status_code == status, (content, resp.text)
        assert resp.json()["error"]["code"] == code
        assert resp.headers["x-request-id"]
    chat = client.post(url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "user",
                                                            "content": "hello world " * 40}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert calls(fakes) == {"p0": 0, "p1": 0, "d0": 0, "d1": 0}


def test_prefill_failure_is_retried_on_other_prefill_worker(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    fakes["p0"].mode = "error_500"
    resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                       headers={"x-request-id": "retry-1"})
    assert resp.status_code == 200, resp.text
    assert calls(fakes) == {"p0": 1, "p1": 1, "d0": 1, "d1": 0}
    assert fakes["d0"].requests[0].body["kv_transfer_params"] == \
        fakes["p1"].kv_params(_upstream(fakes["p1"]))
    wait_metrics(client, url, [
        'pdserve_router_upstream_retries_total{role="prefill"} 1.0',
        'pdserve_router_upstream_errors_total{kind="status",role="prefill"} 1.0',
        'pdserve_router_requests_total{endpoint="completions",model_name="tiny",'
        'status="200"} 1.0',
    ])


def test_missing_kv_transfer_params_is_an_upstream_error(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    fakes["p0"].mode = fakes["p1"].mode = "no_kv_params"
    fakes["d0"].mode = fakes["d1"].mode = "error_500"
    resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    # both prefills answered without params and both decodes failed: a prefill worker, a
    # complete engine, serves the request whole (no params asked, none needed)
    assert resp.status_code == 200
    assert calls(fakes) == {"p0": 2, "p1": 1, "d0": 1, "d1": 1}
    assert "kv_transfer_params" not in fakes["p0"].requests[-1].body
    wait_metrics(client, url, ['pdserve_router_upstream_errors_total{kind="missing_kv_transfer_'
                               'params",role="prefill"} 2.0'])


def test_prefill_client_error_is_relayed_not_retried(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    fakes["p0"].mode = "bad_request"
    resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert resp.status_code == 400
    # vLLM's envelope (an integer code, an exception name as type) leaves in the stable one
    assert resp.json() == {"error": {"message": "injected bad request",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_value"}}
    assert calls(fakes) == {"p0": 1, "p1": 0, "d0": 0, "d1": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_decode_client_error_is_relayed_in_the_stable_envelope(
        stream: bool, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(first_token_from_prefill=False)
    fakes["d0"].mode = "bad_request"
    resp = client.post(url + "/v1/completions",
                       json={"model": "tiny", "prompt": "hi", "stream": stream})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"message": "injected bad request",
                                    "type": "invalid_request_error", "param": None,
                                    "code": "invalid_value"}
    assert calls(fakes) == {"p0": 1, "p1": 0, "d0": 1, "d1": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_decode_failure_before_first_byte_is_retried(
        stream: bool, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    fakes["d0"].mode = "error_500"
    body = {"model": "tiny", "prompt": "hi", "stream": stream}
    resp = client.post(url + "/v1/completions", json=body, headers={"x-request-id": "dr-1"})
    assert resp.status_code == 200, resp.text
    assert calls(fakes) == {"p0": 1, "p1": 0, "d0": 1, "d1": 1}
    # d0 answered (a 500): it may have pulled and released p0's lease, so the retry on d1
    # carries no kv_transfer_params and computes the prompt itself (security review #2).
    assert fakes["d0"].requests[0].body["kv_transfer_params"] == \
        fakes["p0"].kv_params(_upstream(fakes["p0"]))
    assert "kv_transfer_params" not in fakes["d1"].requests[0].body
    wait_metrics(client, url, ["pdserve_router_kv_params_withdrawn_total 1.0"])
    if stream:
        assert _events(resp.content) == [_without_ids(e) for e in _events(fakes["d1"].sent[0])]


@pytest.mark.parametrize("release", [True, False])
def test_params_no_decode_received_have_their_lease_released(
        release: bool, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Security review #14: d0 answered 500 to the decode with p0's params and d1 served the
    request without them, so no decode will read or release p0's lease. The router releases
    it through a decode (a request vLLM refuses before its engine, which frees the params).
    Control: with ``release_unspent_kv`` off nothing is sent (the lease expires)."""
    url = start_router(release_unspent_kv=release)
    fakes["d0"].mode = "error_500"
    resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert resp.status_code == 200, resp.text
    if not release:
        time.sleep(0.5)  # what a release would have taken
        assert fakes["d0"].releases == fakes["d1"].releases == []
        return
    wait_metrics(client, url, [
        'pdserve_router_unspent_kv_releases_total{outcome="released"} 1.0'])
    (sent,) = fakes["d0"].releases + fakes["d1"].releases
    params = fakes["p0"].kv_params(_upstream(fakes["p0"]))
    assert {k: v for k, v in sent.items() if k in params} == params  # plus its signature
    assert calls(fakes) == {"p0": 1, "p1": 0, "d0": 1, "d1": 1}  # nothing else ran


def _events(raw: bytes) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e)
            for e in (part.removeprefix(b"data: ").decode() for part in raw.split(b"\n\n"))
            if e]


def _without_ids(event: Any) -> Any:
    if not isinstance(event, dict):
        return event
    event = json.loads(json.dumps(event))
    if "prompt_token_ids" in event:
        event["prompt_token_ids"] = None
    for choice in event.get("choices") or ():
        for key in ("prompt_token_ids", "token_ids"):
            if key in choice:
                choice[key] = None
    return event


def _text(events: list[Any]) -> str:
    out = ""
    for e in events:
        for c in e.get("choices") or () if isinstance(e, dict) else ():
            out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


def test_without_migration_a_stream_is_relayed_byte_for_byte(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(migration_limit=0)
    path, body = stream_request(False)
    with client.stream("POST", url + path, json=body) as resp:
        relayed = b"".join(resp.iter_raw())
    assert fakes["d0"].sent == [relayed]
    assert "return_token_ids" not in fakes["d0"].requests[0].body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("mode", ["die_mid_stream", "stall_mid_stream"])
def test_a_stream_whose_decode_fails_mid_stream_moves_and_completes(
        mode: str, chat: bool, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Fault transparency: d0 dies (or goes silent) after two tokens; the stream goes on on
    d1 from the prompt's ids plus the two ids sent, and the client sees one complete stream
    (one id, no error event, usage counting each token once)."""
    url = start_router(stall_timeout_s=0.5)
    fakes["d0"].mode = mode  # type: ignore[assignment]
    path, body = stream_request(chat)
    with client.stream("POST", url + path, json=body) as resp:
        assert resp.status_code == 200
        events = _events(b"".join(resp.iter_raw()))
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict))
    assert _text(events) == "".join(DECODE_PIECES)
    assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}
    assert events[-2]["usage"] == {"prompt_tokens": 7, "completion_tokens": 6,
                                   "total_tokens": 13}
    moved = fakes["d1"].requests[0]
    assert moved.path == "/v1/completions"  # a chat stream goes on as a completion
    assert moved.body["prompt"] == [1, 2, 3, 4, 5, 6, 7, 100, 101]
    assert moved.body["max_tokens"] == 4 and "kv_transfer_params" not in moved.body
    reason = "stall" if mode == "stall_mid_stream" else "protocol"
    wait_metrics(client, url, [f'pdserve_router_migrations_total{{reason="{reason}"}} 1.0',
                               'pdserve_router_in_flight_requests{role="decode"} 0.0'])


@pytest.mark.parametrize("mode", ["die_mid_stream", "stall_mid_stream"])
def test_mid_stream_decode_failure_ends_with_error_event_when_moves_are_off(
        mode: str, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Negative control of the move: --migration-limit 0 ends the stream with one error
    event after what was produced."""
    url = start_router(decode_timeout_s=1.0, migration_limit=0)
    fakes["d0"].mode = mode  # type: ignore[assignment]
    fakes["d1"].mode = mode  # type: ignore[assignment]
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        relayed = b"".join(resp.iter_raw())
    events = [e for e in relayed.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))
    assert error["error"]["code"] == "upstream_stream_error"
    assert error["error"]["type"] == "upstream_error"
    # before it, the open choice ends "abort" under the stream's id (review finding 18)
    finish = json.loads(events[-3].removeprefix(b"data: "))
    assert [c["finish_reason"] for c in finish["choices"]] == ["abort"]
    assert finish["id"] == json.loads(events[0].removeprefix(b"data: "))["id"]
    worker = fakes["d0"]
    assert relayed.startswith(worker.sent[0])  # what was produced got through unchanged
    assert calls(fakes)["d1"] == 0  # no retry once bytes reached the client
    # the router is still healthy and serves the next request
    fakes["d0"].mode = fakes["d1"].mode = "ok"
    assert client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
                       ).status_code == 200


def test_a_stream_that_keeps_failing_stops_at_the_migration_limit(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(migration_limit=1)
    for fake in fakes.values():
        fake.mode = "die_mid_stream"
    body = {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 6}
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        events = _events(b"".join(resp.iter_raw()))
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert _text(events) == "".join(DECODE_PIECES[:4])  # two on d0, two on the one move
    wait_metrics(client, url, ['pdserve_router_migrations_total{reason="protocol"} 1.0',
                               'pdserve_router_migrations_refused_total{reason="limit"} 1.0'])


def test_a_stream_that_cannot_be_continued_ends_with_an_error_event(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """A stop string may span the move: such a stream is never continued elsewhere."""
    url = start_router()
    fakes["d0"].mode = "die_mid_stream"
    body = {"model": "tiny", "prompt": "hi", "stream": True, "stop": ["zzz"]}
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        events = _events(b"".join(resp.iter_raw()))
    assert "error" in events[-2] and calls(fakes)["d1"] == 0
    assert "return_token_ids" not in fakes["d0"].requests[0].body


def test_client_disconnect_mid_stream_releases_the_decode_slot(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    fakes["d0"].mode = "stall_mid_stream"
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_raw())
        assert first.startswith(b"data: ")
    wait_metrics(client, url, ['pdserve_router_in_flight_requests{role="decode"} 0.0'])


def test_no_live_workers_is_503(
        redis_server: RedisServer, start_router: Callable[..., str],
        workers: dict[str, FakeWorker], client: httpx.Client) -> None:
    # A registered model whose every worker is gone: 503 before any worker call.
    register(redis_server.url, [_static_record("gone-p", "prefill", "gone")])
    try:
        url = start_router()
        models = client.get(url + "/v1/models").json()
        assert {m["id"] for m in models["data"]} == {"tiny", "gone"}
        client.post(url + "/v1/completions", json={"model": "gone", "prompt": "hi"})  # evicts
        resp = client.post(url + "/v1/completions", json={"model": "gone", "prompt": "hi"})
        assert resp.status_code in (404, 503), resp.text
    finally:
        deregister(redis_server.url, ["gone-p"])


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_lone_pool_serves_whole_requests(
        role: str, redis_server: RedisServer, start_router: Callable[..., str],
        workers: dict[str, FakeWorker], client: httpx.Client) -> None:
    """Fault transparency (role fallback): with no prefill (or no decode) worker left for a
    model, a worker of the other role, a complete vLLM, serves the whole request, with no
    kv_transfer_params, instead of a 503."""
    model = f"solo-{role}"  # a model of its own: records outlive the test in Redis
    lone = FakeWorker(f"solo-{role}", role, model=model).start()  # type: ignore[arg-type]
    try:
        register(redis_server.url, [lone.record()])
        url = start_router()
        resp = client.post(url + "/v1/completions",
                           json={"model": model, "prompt": "hi", "max_tokens": 5})
        assert resp.status_code == 200, resp.text
        (sent,) = lone.requests
        assert "kv_transfer_params" not in sent.body and sent.body["max_tokens"] == 5
        path = "decode_only" if role == "decode" else "prefill_whole"
        reason = "no_prefill_worker" if role == "decode" else "no_decode_worker"
        wait_metrics(client, url, [
            f'pdserve_router_paths_total{{path="{path}",reason="{reason}"}} 1.0'])
    finally:
        lone.stop()
        deregister(redis_server.url, [lone.worker_id])


def test_without_role_fallback_a_lone_pool_answers_503(
        redis_server: RedisServer, start_router: Callable[..., str],
        workers: dict[str, FakeWorker], client: httpx.Client) -> None:
    """Control of role fallback: with ``role_fallback`` off, a decode left alone for its model
    gets nothing and the client a 503 (the operator keeps prompts off its decodes)."""
    model = "solo-nofallback"
    lone = FakeWorker("solo-nofallback", "decode", model=model).start()
    try:
        register(redis_server.url, [lone.record()])
        url = start_router(role_fallback=False)
        resp = client.post(url + "/v1/completions",
                           json={"model": model, "prompt": "hi", "max_tokens": 5})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "no_workers_available"
        assert lone.requests == []
    finally:
        lone.stop()
        deregister(redis_server.url, [lone.worker_id])


def test_when_every_prefill_fails_a_decode_serves_the_request_whole(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Role fallback mid-request: both prefills fail (5xx), so the decode computes the prompt
    itself (nothing was leased). Control: test_completion_two_step_flow_sends_rewritten_bodies,
    where the decode gets the prefill's params."""
    url = start_router()
    fakes["p0"].mode = fakes["p1"].mode = "error_500"
    resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "".join(DECODE_PIECES)
    assert calls(fakes) == {"p0": 1, "p1": 1, "d0": 1, "d1": 0}
    assert "kv_transfer_params" not in fakes["d0"].requests[0].body
    wait_metrics(client, url, [
        'pdserve_router_paths_total{path="decode_only",reason="prefill_failed"} 1.0'])


def _static_record(worker_id: str, role: str, model: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, model=model, model_path="/none",  # type: ignore[arg-type]
                        http_url="http://127.0.0.1:9", engine_id="e", ucx_address="",
                        max_model_len=128, started_at=0.0)


def test_health_and_models(start_router: Callable[..., str], workers: dict[str, FakeWorker],
                           client: httpx.Client) -> None:
    url = start_router()
    health = client.get(url + "/health")
    assert health.status_code == 200
    assert health.json()["prefill_workers"] >= 2 and health.json()["decode_workers"] >= 2
    assert health.json()["redis"] == "ok"


def test_empty_pool_health_is_503(redis_server: RedisServer, client: httpx.Client) -> None:
    server = ServerThread(create_app(RouterSettings(redis_url=redis_server.url,
                                                    redis_prefix="empty-pool"))).start()
    try:
        resp = client.get(server.url + "/health")
        assert resp.status_code == 503
        assert resp.json()["prefill_workers"] == 0
    finally:
        server.stop()


def test_router_keeps_serving_when_redis_stops(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    own = start_redis()
    try:
        register(own.url, [f.record() for f in fakes.values()])
        url = start_router(redis_url=own.url)
        own.stop()
        deadline = time.monotonic() + 15
        while client.get(url + "/health").json()["redis"] != "unreachable":
            assert time.monotonic() < deadline, "router never noticed Redis was down"
            time.sleep(0.05)
        assert client.get(url + "/health").status_code == 200
        resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status_code == 200, resp.text
        assert sum(calls(fakes).values()) == 2
    finally:
        own.stop()


def test_dualmap_keeps_a_repeated_prompt_on_one_prefill_worker(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(policy="dualmap")
    prompt = "same prompt " * 3  # >= 16 tokens (one hashed block), within the 64-token context
    for _ in range(3):
        resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt})
        assert resp.status_code == 200, resp.text
    seen = calls(fakes)
    assert sorted([seen["p0"], seen["p1"]]) == [0, 3]


@pytest.mark.parametrize(("extra", "reason"), [
    ({"n": 2}, "n_gt_1"), ({"prompt": ["hi", "bye"]}, "batched_prompts"),
    ({"prompt": [[1, 2], [3, 4]], "n": 2, "stream": True}, "n_gt_1")])
def test_several_choices_or_prompts_are_served_whole_by_a_decode(
        extra: dict[str, object], reason: str, fakes: dict[str, FakeWorker],
        start_router: Callable[..., str], client: httpx.Client) -> None:
    """``n > 1`` and batched prompts (which vLLM serves, and P/D does not split) go whole to one
    worker, unchanged; control: a single prompt with n=1 takes the prefill (the two-step test)."""
    url = start_router()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra}
    resp = client.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert calls(fakes)["p0"] + calls(fakes)["p1"] == 0
    (sent,) = [r for f in fakes.values() for r in f.requests]
    assert sent.body == body  # the client's body as it is: no kv_transfer_params
    wait_metrics(client, url, [
        f'pdserve_router_paths_total{{path="decode_only",reason="{reason}"}} 1.0'])
