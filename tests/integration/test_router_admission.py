"""Admission control and request limits: real router under uvicorn, real Redis, fake workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.fakes.fake_worker import FakeWorker
from tests.support.router import calls
from tests.support.waiting import eventually

BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 4}


def _error(resp: httpx.Response) -> dict[str, Any]:
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_full_pool_answers_429_with_retry_after_and_sends_nothing(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(max_in_flight_per_worker=2, load_poll_interval_s=0.05)
    assert client.post(url + "/v1/completions", json=BODY).status_code == 200  # room: admitted
    for wid in ("d0", "d1"):
        fakes[wid].gauges["running"] = 2  # busy with requests from elsewhere
    eventually(lambda: client.get(url + "/workers").json()["data"],
               lambda data: all((w["reported"] or {}).get("running") == 2
                                for w in data if w["role"] == "decode"), timeout_s=10)
    before = dict(calls(fakes))
    resp = client.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "1"
    assert _error(resp)["code"] == "server_overloaded"
    assert calls(fakes) == before  # refused before any worker was asked
    assert 'pdserve_router_rejected_requests_total{pool="decode"} 1.0' in \
        client.get(url + "/metrics").text
    fakes["d1"].gauges["running"] = 1  # one decode has room again
    eventually(lambda: client.post(url + "/v1/completions", json=BODY).status_code,
               lambda status: status == 200, timeout_s=10)


def test_limits_on_body_prompt_and_max_tokens(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(max_body_bytes=2000, max_prompt_tokens=20, max_output_tokens=8)
    cases = [({**BODY, "prompt": "x" * 3000}, 413, "request_too_large", None),
             ({**BODY, "prompt": "river " * 30}, 400, "prompt_too_long", "prompt"),
             ({**BODY, "max_tokens": 9}, 400, "max_tokens_too_large", "max_tokens")]
    for body, status, code, param in cases:
        resp = client.post(url + "/v1/completions", json=body)
        assert resp.status_code == status, resp.text
        assert _error(resp)["code"] == code and _error(resp)["param"] == param
    assert calls(fakes) == {"p0": 0, "p1": 0, "d0": 0, "d1": 0}
    # Negative control: at the limits, the same requests pass.
    assert client.post(url + "/v1/completions",
                       json={**BODY, "prompt": "river " * 5, "max_tokens": 8}).status_code == 200


def test_request_deadline_bounds_a_stalled_answer(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(request_timeout_s=1.0)
    fakes["d0"].mode = fakes["d1"].mode = "stall"
    for stream in (False, True):
        resp = client.post(url + "/v1/completions", json={**BODY, "stream": stream})
        assert resp.status_code == 504
        assert _error(resp)["code"] == "deadline_exceeded"
    # The router is not wedged: with the decoders back, the next request is served.
    fakes["d0"].mode = fakes["d1"].mode = "ok"
    assert client.post(url + "/v1/completions", json=BODY).status_code == 200


def test_requests_sharing_a_client_id_leak_nothing_in_the_ledger(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Security review finding 11: two requests in flight under one ``X-Request-Id`` on one
    prefill used to share a ledger entry, leaving one's tokens pending forever (enough of them
    and admission answers 429 to everybody). The router keys its ledger by its own id."""
    import threading

    for fake in fakes.values():
        fake.mode = "stall"  # both stay in flight until the router gives up on them
    # one decode retry: a decode failing after every decode was tried also goes to a prefill
    # (any engine can finish a request), which would outlast the client's 30 s here
    url = start_router(policy="consistent_hash", prefill_retries=0, prefill_timeout_s=1.5,
                       decode_retries=1, decode_timeout_s=2.0)
    statuses: list[int] = []

    def send(prompt: str) -> None:
        resp = httpx.post(url + "/v1/completions", timeout=30, headers={"x-request-id": "dup"},
                          json={**BODY, "prompt": prompt})
        statuses.append(resp.status_code)
        assert resp.headers["x-request-id"] == "dup"  # the client's id is still echoed

    threads = [threading.Thread(target=send, args=("same prefix " * 3 + tail,))
               for tail in ("a", "b b b b b b b b")]
    for thread in threads:
        thread.start()
    # control: both really are in flight at once, on the same prefill, with their tokens
    busy = eventually(lambda: (statuses, client.get(url + "/workers").json()["data"]),
                      lambda got: any(w["in_flight"] == 2 for w in got[1]), timeout_s=10)[1]
    (held,) = [w for w in busy if w["in_flight"] == 2]
    assert held["pending_prefill_tokens"] > 0
    for thread in threads:
        thread.join()
    assert statuses == [504, 504]
    after = {w["worker_id"]: w for w in client.get(url + "/workers").json()["data"]}
    assert after[held["worker_id"]]["in_flight"] == 0
    assert after[held["worker_id"]]["pending_prefill_tokens"] == 0
