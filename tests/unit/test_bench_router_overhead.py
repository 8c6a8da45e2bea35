"""The pure parts of ``python -m bench.router_overhead``: the fake backend's events against vLLM
0.32's own, HTTP framing both ways, ``/proc`` parsing and the added-latency arithmetic."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.fake_openai import parse_requests, prompt_ids, stream_events, whole_answer
from bench.lean_client import Timing, _Response
from bench.overhead_stats import (
    Point,
    added_ms,
    others_ticks,
    poisson_offsets,
    process_cpu_ticks,
    table,
    user_processes_ticks,
)

# What vLLM 0.32 streams, written by its own pydantic models (CompletionStreamResponse /
# ChatCompletionStreamResponse with the arguments its serving code passes, model_dump_json as
# it calls it) for a 2-token answer to a 3-token prompt, ids requested, usage included.
VLLM_COMPLETION = [
    '{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":'
    '[{"index":0,"text":" w0","logprobs":null,"finish_reason":null,"stop_reason":null,'
    '"prompt_token_ids":[1,2,3],"token_ids":[1000]}]}',
    '{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":'
    '[{"index":0,"text":" w1","logprobs":null,"finish_reason":"length","stop_reason":null,'
    '"prompt_token_ids":null,"token_ids":[1001]}]}',
    '{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}',
    "[DONE]",
]
VLLM_CHAT = [
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    '"finish_reason":null}],"prompt_token_ids":[1,2,3],"prompt_text":null}',
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'
    '"choices":[{"index":0,"delta":{"content":" w0"},"logprobs":null,"finish_reason":null,'
    '"token_ids":[1000]}]}',
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'
    '"choices":[{"index":0,"delta":{"content":" w1"},"logprobs":null,"finish_reason":"length",'
    '"stop_reason":null,"token_ids":[1001]}]}',
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'
    '"choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}',
    "[DONE]",
]


def _payloads(events: list[bytes]) -> list[str]:
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    return [e[6:-2].decode() for e in events]


@pytest.mark.parametrize(("chat", "expected"), [(False, VLLM_COMPLETION), (True, VLLM_CHAT)],
                         ids=["completions", "chat"])
def test_the_fake_streams_vllms_exact_events(chat: bool, expected: list[str]) -> None:
    events = stream_events(chat=chat, model="m", response_id="chatcmpl-1" if chat else "cmpl-1",
                           tokens=2, prompt=[1, 2, 3], token_ids=True, include_usage=True)
    assert _payloads(events) == expected


def test_without_ids_or_usage_the_ids_read_null_and_no_usage_event() -> None:
    events = stream_events(chat=False, model="m", response_id="cmpl-1", tokens=2,
                           prompt=[1, 2, 3], token_ids=False, include_usage=False)
    first = json.loads(_payloads(events)[0])
    assert first["choices"][0]["prompt_token_ids"] is None
    assert first["choices"][0]["token_ids"] is None
    assert len(events) == 3 and events[-1] == b"data: [DONE]\n\n"


VLLM_WHOLE = (
    '{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":'
    '[{"index":0,"text":" w0 w1","logprobs":null,"finish_reason":"length","stop_reason":null,'
    '"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],'
    '"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":3,"total_tokens":5,'
    '"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},'
    '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}')


def test_whole_answer_is_vllms() -> None:
    answer = whole_answer(chat=False, model="m", response_id="cmpl-1", tokens=2,
                          prompt=[1, 2, 3])
    assert json.dumps(answer, separators=(",", ":")) == VLLM_WHOLE
    chat = whole_answer(chat=True, model="m", response_id="chatcmpl-1", tokens=2, prompt=[1])
    assert chat["choices"][0]["message"]["content"] == " w0 w1"


def test_prompt_ids_one_per_four_bytes_or_the_ids_themselves() -> None:
    assert prompt_ids({"prompt": "abcdefgh"}) == [1, 2, 3]
    assert prompt_ids({"prompt": [7, 8]}) == [7, 8]


def test_requests_are_parsed_by_length_or_chunks_and_partial_ones_wait() -> None:
    buf = bytearray(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}"
                    b"POST /v1/x?y=1 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                    b"GET /health HTTP/1.1\r\n")
    got = parse_requests(buf)
    assert [(r.method, r.path, r.body) for r in got] == [
        ("POST", "/v1/completions", b"{}"), ("POST", "/v1/x", b"abcde")]
    assert buf == b"GET /health HTTP/1.1\r\n"
    buf += b"\r\n"
    assert [(r.method, r.path) for r in parse_requests(buf)] == [("GET", "/health")]
    assert buf == b""


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_a_response_split_anywhere_is_timed_and_checked() -> None:
    events = stream_events(chat=False, model="m", response_id="cmpl-1", tokens=2, prompt=[1],
                           token_ids=False, include_usage=True)
    raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(*events)
    for cut in range(1, len(raw)):
        timing = Timing(0.0)
        response = _Response(timing, sent=10.0, stream=True, tokens=2)
        response.feed(raw[:cut], now=10.001)
        response.feed(raw[cut:], now=10.003)
        assert response.done.done() and timing.ok, (cut, timing)
        assert timing.ttlb_s == pytest.approx(0.003)
        # the first text arrived with the first part if that part held the whole first chunk
        first_chunk_end = raw.index(b"\r\n", raw.index(b"w0")) + 2
        assert timing.ttft_s == pytest.approx(0.001 if cut >= first_chunk_end else 0.003)


async def test_a_stream_missing_tokens_or_done_is_an_error() -> None:
    events = stream_events(chat=False, model="m", response_id="cmpl-1", tokens=2, prompt=[1],
                           token_ids=False, include_usage=False)
    for body in (_chunked(*events[:1], events[-1]), _chunked(*events[:-1])):
        timing = Timing(0.0)
        _Response(timing, 0.0, stream=True, tokens=2).feed(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body, now=1.0)
        assert timing.error.startswith("incomplete")
    timing = Timing(0.0)
    _Response(timing, 0.0, stream=True, tokens=2).feed(
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}", now=1.0)
    assert timing.error == "http_503" and not timing.ok
    await asyncio.sleep(0)


def test_proc_stat_parsing() -> None:
    # a process name with a space and a parenthesis: fields count after the last ")"
    stat = "1234 (we (ird) x) S 1 1234 1234 0 -1 4194560 500 0 0 0 250 75 0 0 20 0 3 0 100"
    assert process_cpu_ticks(stat) == 325
    kernel = "2 (ksoftirqd/0) S 2 0 0 0 -1 69238880 0 0 0 0 0 900 0 0 20 0 1 0 10"
    stats = {1234: stat, 2: kernel, 7: stat.replace("250 75", "10 5")}
    before = user_processes_ticks(stats, ignore=[7])
    assert before == {1234: 325}  # the kernel thread (PF_KTHREAD) and ours are left out
    after = {1234: 400, 99: 20}  # one went on, one started since
    assert others_ticks(before, after) == 75 + 20


def test_poisson_offsets_are_seeded_increasing_and_near_the_rate() -> None:
    a = poisson_offsets(500.0, 10.0, seed=3)
    assert a == poisson_offsets(500.0, 10.0, seed=3) != poisson_offsets(500.0, 10.0, seed=4)
    assert all(0 < x < y < 10.0 for x, y in zip(a, a[1:], strict=False))
    assert 4700 < len(a) < 5300  # 5,000 expected, sd ~71


def _point(setup: str, ttlb_ms: list[float], cpu_s: float | None = None,
           errors: int = 0) -> Point:
    ok = tuple(Timing(0.0, lag_s=0.0, ttft_s=t / 2e3, ttlb_s=t / 1e3, status=200)
               for t in ttlb_ms)
    bad = tuple(Timing(0.0, lag_s=0.0, error="timeout") for _ in range(errors))
    return Point(setup, 100.0, 1.0, ok + bad, cpu_s, 0.05, 0.5)


def test_added_latency_is_a_difference_of_percentiles() -> None:
    direct = _point("direct", [1.0, 2.0, 3.0, 4.0, 5.0])
    router = _point("pdserve", [2.0, 2.5, 3.0, 9.0, 10.0], cpu_s=0.003, errors=1)
    assert added_ms(router, direct, 50) == pytest.approx(0.0)  # 3.0 - 3.0
    # p99 by linear interpolation: 9 + 0.96 * 1 = 9.96 against 4 + 0.96 * 1 = 4.96
    assert added_ms(router, direct, 99) == pytest.approx(5.0)
    assert router.errors == 1 and router.sent_rps == 6.0
    assert router.router_cpu_ms_per_request == pytest.approx(0.5)  # 3 ms over 6 requests
    rows = table([direct, router]).splitlines()
    assert rows[2].startswith("| direct | 100 | 5.0 | 3.00 |")
    assert "| 0.00 | 5.00 | 0.500 | 1 |" in rows[3] and rows[3].endswith("| 5% | 0.50 |")
