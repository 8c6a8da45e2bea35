"""The real router under uvicorn, real Redis, fake workers: request metrics carry the served
model, token counters equal the usage the worker returned, ITL counts the gaps of a stream."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable

import httpx
import pytest

from router.samples import Samples
from tests.fakes.fake_worker import DECODE_PIECES, FakeWorker
from tests.support.metrics import scrape, value
from tests.support.router import stream_request, wait_metrics
from tests.support.waiting import eventually

FAKE_PROMPT_TOKENS = 7  # the usage record of tests.fakes.fake_worker
FAKE_COMPLETION_TOKENS = len(DECODE_PIECES)


def _content_events(raw: bytes) -> int:
    """Events of a relayed stream that carry generated text, counted on the client side."""
    n = 0
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        for choice in json.loads(event[6:]).get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                n += 1
    return n


def _model_labels(samples: Samples) -> set[str]:
    return {dict(labels)["model_name"] for (name, labels) in samples
            if name.startswith("pdserve_router_") and "model_name" in dict(labels)}


def test_non_streamed_usage_counts_tokens_under_the_model_label(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    for _ in range(2):
        resp = client.post(url + "/v1/completions",
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 6})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == FAKE_PROMPT_TOKENS
    s = scrape(url)
    assert value(s, "pdserve_router_prompt_tokens_total", model_name="tiny") == \
        2 * FAKE_PROMPT_TOKENS
    assert value(s, "pdserve_router_generation_tokens_total", model_name="tiny") == \
        2 * FAKE_COMPLETION_TOKENS
    assert value(s, "pdserve_router_requests_total", endpoint="completions", status="200",
                 model_name="tiny") == 2
    assert value(s, "pdserve_router_request_duration_seconds_count", model_name="tiny") == 2
    assert value(s, "pdserve_router_prefill_duration_seconds_count", model_name="tiny") == 2
    assert value(s, "pdserve_router_inter_token_latency_seconds_count") == 0  # not a stream
    assert _model_labels(s) == {"tiny"}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_usage_chunk_and_inter_token_latency(
        chat: bool, fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router()
    endpoint = "chat_completions" if chat else "completions"
    path, body = stream_request(chat)
    with client.stream("POST", url + path, json=body) as resp:
        assert resp.status_code == 200
        relayed = b"".join(resp.iter_raw())
    chunks = _content_events(relayed)
    assert chunks == len(DECODE_PIECES)  # the chat role chunk carries no content
    # Stream accounting closes right after the last byte, possibly after the client has it.
    wait_metrics(client, url, [f'pdserve_router_requests_total{{endpoint="{endpoint}",'
                               'model_name="tiny",status="200"} 1.0'])
    s = scrape(url)
    assert value(s, "pdserve_router_prompt_tokens_total", model_name="tiny") == \
        FAKE_PROMPT_TOKENS
    assert value(s, "pdserve_router_generation_tokens_total", model_name="tiny") == \
        FAKE_COMPLETION_TOKENS
    assert value(s, "pdserve_router_inter_token_latency_seconds_count", model_name="tiny") == \
        chunks - 1
    itl_sum = value(s, "pdserve_router_inter_token_latency_seconds_sum", model_name="tiny")
    e2e = value(s, "pdserve_router_request_duration_seconds_sum", model_name="tiny")
    assert 0 <= itl_sum <= e2e
    assert value(s, "pdserve_router_ttft_seconds_count", endpoint=endpoint,
                 model_name="tiny") == 1


def test_stream_without_usage_counts_gaps_but_no_tokens(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """The router reads usage, it does not ask for it: a stream whose client did not ask for
    include_usage carries none (the workers' vllm:*_tokens_total count it)."""
    url = start_router()
    with client.stream("POST", url + "/v1/completions",
                       json={"model": "tiny", "prompt": "hello", "stream": True}) as resp:
        assert resp.status_code == 200
        relayed = b"".join(resp.iter_raw())
    assert b'"usage"' not in relayed
    wait_metrics(client, url, ['pdserve_router_requests_total{endpoint="completions",'
                               'model_name="tiny",status="200"} 1.0'])
    s = scrape(url)
    assert value(s, "pdserve_router_inter_token_latency_seconds_count", model_name="tiny") == \
        _content_events(relayed) - 1
    assert value(s, "pdserve_router_prompt_tokens_total") == 0
    assert value(s, "pdserve_router_generation_tokens_total") == 0


def test_model_label_never_takes_client_input(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Unknown models and unparsable bodies are answered before a model is known: they are
    labelled model_name="" and no series is created for what the client wrote."""
    url = start_router()
    for i in range(3):
        resp = client.post(url + "/v1/completions",
                           json={"model": f"client-made-{i}", "prompt": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    bad = client.post(url + "/v1/completions", content=b"{broken",
                      headers={"content-type": "application/json"})
    assert bad.status_code == 400
    ok = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello"})
    assert ok.status_code == 200, ok.text
    s = scrape(url)
    assert _model_labels(s) == {"", "tiny"}
    assert value(s, "pdserve_router_requests_total", status="404", model_name="") == 3
    assert value(s, "pdserve_router_requests_total", status="400", model_name="") == 1
    assert value(s, "pdserve_router_requests_total", status="200", model_name="tiny") == 1
    assert value(s, "pdserve_router_prompt_tokens_total", model_name="") == 0


def test_arrivals_are_counted_when_they_arrive_not_when_answered(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """The autoscaler's arrival rate: a request whose decode has not answered yet is already
    counted as received, while the answer counter has nothing yet (negative control); a request
    for an unknown model is no arrival."""
    url = start_router(decode_timeout_s=3.0)
    for fake in fakes.values():
        if fake.role == "decode":
            fake.mode = "stall"
    assert client.post(url + "/v1/completions",
                       json={"model": "nobody-serves-this", "prompt": "x"}).status_code == 404
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, url + "/v1/completions",
                             json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        s = eventually(lambda: scrape(url), lambda m: value(
            m, "pdserve_router_in_flight_requests", role="decode") == 1, timeout_s=30)
        assert value(s, "pdserve_router_requests_received_total", endpoint="completions",
                     model_name="tiny") == 1
        assert value(s, "pdserve_router_requests_total", model_name="tiny") == 0
        # the stalled decodes timed out; a prefill worker (a complete engine) served it whole
        assert answer.result(timeout=60).status_code == 200
    s = scrape(url)
    assert value(s, "pdserve_router_requests_total", model_name="tiny") == 1
    assert value(s, "pdserve_router_requests_received_total") == 1
