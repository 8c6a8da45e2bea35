"""Router load accounting merged with the workers' own reports (pure parts)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from router.samples import only_samples, parse_samples
from router.state.load import LoadTracker
from router.state.registry import WorkerRecord
from router.state.worker_load import LOAD_SAMPLES, WorkerLoad, WorkerLoadPoller, worker_load

# vLLM's exposition of the three gauges (two engines, as a data-parallel worker labels them)
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""

# What else vLLM exposes beside them: a histogram, a counter, and names that start like them
OTHER_TEXT = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.7
# HELP vllm:num_requests_running_by_lora Lookalike of a wanted name.
# TYPE vllm:num_requests_running_by_lora gauge
vllm:num_requests_running_by_lora{engine="0",model_name="m"} 99.0
# HELP vllm:num_requests_waiting_total Another lookalike.
# TYPE vllm:num_requests_waiting_total counter
vllm:num_requests_waiting_total 42.0
"""


def _record(wid: str, role: str) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, role=role, model="m", model_path="/m",  # type: ignore[arg-type]
                        http_url="http://127.0.0.1:1", engine_id=wid, ucx_address="",
                        max_model_len=128, started_at=0.0)


def test_worker_load_sums_engines_and_takes_the_fullest_kv_cache() -> None:
    load = worker_load(parse_samples(VLLM_TEXT), own_in_flight=2, at_s=7.0)
    assert load == WorkerLoad(running=5, waiting=4, kv_usage=0.5, own_in_flight=2,
                              scraped_at_s=7.0)


def test_worker_load_is_none_without_vllm_gauges() -> None:
    text = "# TYPE other gauge\nother 1.0\n" + VLLM_TEXT.split("# HELP vllm:kv")[0]
    assert worker_load(parse_samples(text)) is None


def test_malformed_exposition_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_samples("vllm:num_requests_running{engine=0 1.0\n")


def test_named_parse_keeps_exactly_the_wanted_samples() -> None:
    """The load probe parses only vLLM's three gauges (the whole exposition held the router's
    event loop ~10 ms per worker per second, and the relayed streams stalled behind it)."""
    text = OTHER_TEXT + VLLM_TEXT + OTHER_TEXT.replace('engine="0"', 'engine="1"')
    everything = parse_samples(text)
    wanted = parse_samples(text, LOAD_SAMPLES)
    assert wanted == {k: v for k, v in everything.items() if k[0] in LOAD_SAMPLES}
    assert len(wanted) == 6
    # control: the lookalikes and the histogram are in the exposition, and are left out
    assert {k[0] for k in everything} - set(LOAD_SAMPLES) >= {
        "vllm:num_requests_running_by_lora", "vllm:num_requests_waiting_total",
        "vllm:time_to_first_token_seconds_bucket"}
    assert worker_load(wanted) == worker_load(everything)
    assert only_samples(text, ()) == "" and parse_samples(text, ()) == {}


def test_named_parse_checks_only_the_kept_lines() -> None:
    """A malformed line of another family does not cost the load (the full parse refuses the
    whole exposition); a malformed wanted line is still refused."""
    broken_other = "vllm:something_else{engine=0 1.0\n" + VLLM_TEXT
    with pytest.raises(ValueError):
        parse_samples(broken_other)
    assert worker_load(parse_samples(broken_other, LOAD_SAMPLES)) is not None
    broken_wanted = VLLM_TEXT + "vllm:num_requests_running{engine=0 1.0\n"
    with pytest.raises(ValueError):
        parse_samples(broken_wanted, LOAD_SAMPLES)


@pytest.mark.parametrize(("role", "reported", "expected"), [
    # (running, waiting, own_in_flight at scrape) -> (running, pending tokens, kv usage)
    ("prefill", None, (2, 300, 0.0)),               # no report: router accounting only
    ("prefill", (2, 0, 2), (2, 300, 0.25)),        # all reported work is ours
    ("prefill", (3, 5, 2), (8, 300 + 6 * 100, 0.25)),  # 6 foreign at the mean of 100 tokens
    ("prefill", (1, 0, 2), (2, 300, 0.25)),        # ours finished since: never negative
    ("decode", (3, 5, 2), (8, 0, 0.25)),           # decode: others' work is running, no tokens
])
def test_candidates_add_what_others_sent(role: str, reported: tuple[int, int, int] | None,
                                         expected: tuple[int, int, float]) -> None:
    tracker = LoadTracker()
    prefill = role == "prefill"
    tracker.start("w", "r1", 200 if prefill else 0, prefill=prefill)
    tracker.start("w", "r2", 100 if prefill else 0, prefill=prefill)
    if prefill:
        assert tracker.mean_prefill_tokens == pytest.approx(200 + 0.05 * (100 - 200))
        tracker.mean_prefill_tokens = 100.0  # round numbers for the table
    loads = {} if reported is None else {
        "w": WorkerLoad(running=reported[0], waiting=reported[1], kv_usage=0.25,
                        own_in_flight=reported[2])}
    (c,) = tracker.candidates([_record("w", role)], loads)
    assert c.in_flight == 2
    assert (c.running, c.pending_prefill_tokens, c.kv_usage) == expected


def test_reports_of_other_workers_are_not_mixed_in() -> None:
    tracker = LoadTracker()
    loads = {"x": WorkerLoad(running=9, waiting=9, kv_usage=0.9)}
    (c,) = tracker.candidates([_record("w", "decode")], loads)
    assert (c.running, c.kv_usage) == (0, 0.0)


class _Members:
    """A fixed membership view (the poller reads only ``workers()``)."""

    def __init__(self, records: list[WorkerRecord]) -> None:
        self.records = records

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return self.records


async def _serve(delays: list[float], text: str = VLLM_TEXT) -> tuple[asyncio.Server, int]:
    """A /metrics server on a free port that waits ``delays[i]`` before its i-th answer
    (the last delay repeats; ``inf`` never answers: a stopped process whose kernel still
    accepts connections)."""
    answered = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        while await reader.readuntil(b"\r\n\r\n"):
            delay = delays[min(answered, len(delays) - 1)]
            answered += 1
            await asyncio.sleep(3600 if delay == float("inf") else delay)
            body = text.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_one_late_answer_is_not_a_stopped_worker() -> None:
    """Issue 23/26: a busy worker answering one probe late kept its requests (a lone timeout
    moved them, and the retried decode's params were refused as a replay); a worker silent
    for ``silent_after_s`` loses them, and one with nothing listening loses them at once."""
    silent, silent_port = await _serve([float("inf")])
    late, late_port = await _serve([1.5, 0.0])
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    records = [WorkerRecord(worker_id=wid, role="decode", model="m", model_path="/m",
                            http_url=f"http://127.0.0.1:{port}", engine_id=wid, ucx_address="",
                            max_model_len=128, started_at=0.0)
               for wid, port in (("silent", silent_port), ("late", late_port),
                                 ("gone", closed_port))]
    async with httpx.AsyncClient(trust_env=False) as client:
        poller = WorkerLoadPoller(_Members(records), lambda: client, lambda wid: 0,
                                  interval_s=1.0, silent_after_s=2.5)
        seen = []
        for _ in range(3):
            await poller.poll()
            seen.append({wid: poller.unresponsive(wid) for wid in ("silent", "late", "gone")})
    silent.close()
    late.close()
    assert seen == [{"silent": False, "late": False, "gone": True},   # one probe unanswered
                    {"silent": False, "late": False, "gone": True},   # two: 2 s of silence
                    {"silent": True, "late": False, "gone": True}]    # three: past 2.5 s
    assert set(poller.loads()) == {"late"}  # it answered again: its load counts


async def test_the_poller_parses_only_the_load_gauges() -> None:
    """The poller's probe keeps a worker's load when another family of its exposition is one
    the full parse refuses: it parsed the three gauges alone."""
    text = "vllm:something_else{engine=0 1.0\n" + OTHER_TEXT + VLLM_TEXT
    server, port = await _serve([0.0], text)
    record = WorkerRecord(worker_id="w", role="decode", model="m", model_path="/m",
                          http_url=f"http://127.0.0.1:{port}", engine_id="w", ucx_address="",
                          max_model_len=128, started_at=0.0)
    async with httpx.AsyncClient(trust_env=False) as client:
        poller = WorkerLoadPoller(_Members([record]), lambda: client, lambda wid: 0)
        await poller.poll()
    server.close()
    with pytest.raises(ValueError):  # control: the whole exposition does not parse
        parse_samples(text)
    assert poller.loads()["w"].running == 5 and not poller.unresponsive("w")
