"""Per-key limits (security review finding 13): concurrency and token rates per API key, and
the answer deadline.

Real router under uvicorn, real Redis, fake workers whose streams can stall mid-answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from starlette.types import Message, Receive, Scope, Send

from router.api.limits import KeyLimits, LimitsMiddleware, client_of
from tests.fakes.fake_worker import FakeWorker
from tests.support.router import calls, wait_metrics
from tests.support.waiting import eventually

BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 6}
KEY_A, KEY_B = "sk-tenant-a-0000000000", "sk-tenant-b-0000000000"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _stall(fakes: dict[str, FakeWorker], stall: bool) -> None:
    for fake in fakes.values():
        fake.mode = "stall_mid_stream" if stall else "ok"


def test_key_limits_count_per_client_and_release_on_leave() -> None:
    limits = KeyLimits(2)
    assert limits.try_enter("a") and limits.try_enter("a")
    assert not limits.try_enter("a")  # third of a: refused, not counted
    assert limits.in_flight("a") == 2
    assert limits.try_enter("b")  # another client has its own budget
    limits.leave("a")
    assert limits.try_enter("a")
    unbounded = KeyLimits(0)
    assert all(unbounded.try_enter("a") for _ in range(100))


def test_a_key_past_its_concurrency_gets_429_and_other_keys_do_not(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    # the held request waits on a prefill that never answers, until the prefill timeout (6 s:
    # the checks below take well under a second, on the cores of a busy CI box a few)
    url = start_router(api_keys=(KEY_A, KEY_B), max_concurrent_per_key=1, prefill_timeout_s=6)
    for fake in fakes.values():
        fake.mode = "stall"
    before = calls(fakes)
    with httpx.Client(trust_env=False, timeout=60.0) as holder, \
            ThreadPoolExecutor(1) as pool:
        held = pool.submit(holder.post, url + "/v1/completions", headers=_auth(KEY_A), json=BODY)
        eventually(lambda: calls(fakes), lambda now: now != before, timeout_s=10)
        asked = calls(fakes)
        refused = client.post(url + "/v1/completions", headers=_auth(KEY_A), json=BODY)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert calls(fakes) == asked  # refused before any worker was asked
        assert client.get(url + "/v1/models", headers=_auth(KEY_A)).status_code == 429
        # control: another key is served at once (a request that needs no worker)
        assert client.get(url + "/v1/models", headers=_auth(KEY_B)).status_code == 200
        assert not held.done()
        _stall(fakes, False)
        held.result(timeout=60)  # the stalled prefill times out; a retry may then serve it
    # the held request ended: its slot is free again
    assert client.post(url + "/v1/completions", headers=_auth(KEY_A), json=BODY).status_code \
        == 200
    wait_metrics(client, url, ['pdserve_router_limited_requests_total{reason="concurrency"} 2.0'])


def test_a_stream_past_the_answer_deadline_ends_with_an_error_event(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(answer_deadline_s=1.5, stall_timeout_s=0, max_concurrent_per_key=1)
    _stall(fakes, True)
    with client.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "answer_deadline_exceeded"
    finish = json.loads(events[-3])  # the open choice ends "abort" first (review finding 18)
    assert [c["finish_reason"] for c in finish["choices"]] == ["abort"]
    assert any(json.loads(e).get("choices") and "abort" not in e
               for e in events[:-3])  # it had started
    # an answer that never starts gets a 504
    for fake in fakes.values():
        fake.mode = "stall"
    resp = client.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "answer_deadline_exceeded"
    wait_metrics(client, url, ['pdserve_router_limited_requests_total{reason="deadline"} 2.0'])
    # the stopped answers left nothing counted (limit 1) and the router serves on
    _stall(fakes, False)
    assert client.post(url + "/v1/completions", json=BODY).status_code == 200


def test_without_limits_a_stalled_stream_is_not_cut(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str]) -> None:
    """Negative control: the same stall with no deadline is still open after the deadline
    above would have ended it, and a second request of the same client is served."""
    url = start_router(stall_timeout_s=0)
    _stall(fakes, True)
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(30.0, read=3.0)) as slow, \
            slow.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        try:
            rest = [line for line in lines if line]
        except httpx.ReadTimeout:
            rest = None  # still open, silent, 3 s in
        assert rest is None, rest
        _stall(fakes, False)
        assert slow.post(url + "/v1/completions", json=BODY).status_code == 200


def test_a_key_is_one_client_however_its_header_is_spelled() -> None:
    def scope(header: bytes) -> dict[str, object]:
        return {"headers": [(b"authorization", header)]}

    one = client_of(scope(b"Bearer " + KEY_A.encode()))
    assert one and KEY_A not in one
    assert client_of(scope(b"bearer  " + KEY_A.encode() + b" ")) == one
    assert client_of(scope(b"Bearer " + KEY_B.encode())) != one
    assert client_of({"headers": []}) == ""


async def test_without_api_keys_every_header_shares_one_budget() -> None:
    """A router without keys checks no header: a client that varies it is still one client.
    Control: with keys, two keys are two clients."""
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def call(limits: LimitsMiddleware, key: str) -> int:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": "/v1/completions",
                 "headers": [(b"authorization", f"Bearer {key}".encode())]}
        await limits(scope, receive, send)
        return int(sent[0]["status"])

    for keyed, second in ((False, 429), (True, 200)):
        release.clear()
        limits = LimitsMiddleware(app, max_concurrent=1, keyed=keyed)
        held = asyncio.create_task(call(limits, KEY_A))
        await asyncio.sleep(0.01)
        other = asyncio.create_task(call(limits, KEY_B))
        await asyncio.sleep(0.01)
        release.set()
        assert (await held, await other) == (200, second), keyed


# -- token-rate limits (--prefill-/--decode-tokens-per-min-per-key) ----------------------------

IDS_PROMPT = {"model": "tiny", "prompt": list(range(10, 30)), "max_tokens": 4}
"""20 prompt tokens (ids are counted as they are), at most 4 output tokens."""


def _refused_for_tokens(resp: httpx.Response) -> None:
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "token_rate_limit_exceeded")


def test_a_key_past_its_prompt_token_rate_gets_429_and_other_keys_do_not(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(api_keys=(KEY_A, KEY_B), prefill_tokens_per_min_per_key=30)

    def post(key: str) -> httpx.Response:
        return client.post(url + "/v1/completions", headers=_auth(key), json=IDS_PROMPT)

    assert post(KEY_A).status_code == 200  # 20 of 30
    before = calls(fakes)
    refused = post(KEY_A)  # 20 more: 10 left (+1 every 2 s)
    _refused_for_tokens(refused)
    assert int(refused.headers["retry-after"]) >= 15
    assert calls(fakes) == before  # refused before any worker was asked
    assert post(KEY_B).status_code == 200  # control: another key has its own budget
    wait_metrics(client, url,
                 ['pdserve_router_limited_requests_total{reason="prefill_tokens"} 1.0'])


def test_a_key_past_its_output_token_rate_gets_429_and_unused_tokens_come_back(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Charged max_tokens at admission, then what the answer's usage says it generated (the
    fakes always generate 6): a request for 8 is settled at 6, leaving 4 of 10 for the next."""
    url = start_router(api_keys=(KEY_A, KEY_B), decode_tokens_per_min_per_key=10)

    def post(key: str, max_tokens: int) -> httpx.Response:
        return client.post(url + "/v1/completions", headers=_auth(key),
                           json={**BODY, "max_tokens": max_tokens})

    assert post(KEY_A, 8).status_code == 200  # charged 8, settled to 6: 4 left
    before = calls(fakes)
    _refused_for_tokens(post(KEY_A, 8))  # 8 > 4
    assert calls(fakes) == before
    assert post(KEY_A, 4).status_code == 200  # 4 fit only because 2 came back
    _refused_for_tokens(post(KEY_A, 1))  # settled at 6 for 4 asked: in debt now
    assert post(KEY_B, 8).status_code == 200  # control: another key
    wait_metrics(client, url,
                 ['pdserve_router_limited_requests_total{reason="decode_tokens"} 2.0'])


def test_without_token_rates_the_same_traffic_is_served(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Negative control of the two tests above: no limit, every request is served."""
    url = start_router(api_keys=(KEY_A, KEY_B))
    for key, body in [(KEY_A, IDS_PROMPT)] * 2 + [(KEY_B, IDS_PROMPT)] + \
            [(KEY_A, {**BODY, "max_tokens": m}) for m in (8, 8, 4, 1)]:
        resp = client.post(url + "/v1/completions", headers=_auth(key), json=body)
        assert resp.status_code == 200, resp.text
