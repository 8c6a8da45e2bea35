"""Fault transparency on a real 1P+1D cluster: a stopped or killed engine costs the client
nothing (issue 23).

The module's own `pdserve up` (1 prefill + 1 decode, vLLM workers, Redis, UCX), each test with a
control router beside the cluster's own, the feature turned off in it:

- the prefill's vLLM is SIGSTOPped while requests wait on it: once it fails the router's load
  probes they are served by the decode, equal to the plain server; through a router with
  ``--stall-timeout-s 0`` a request stays stuck until SIGCONT; after SIGCONT nothing is left
  running or leased on the prefill;
- eight greedy streams through each router are mid-way when the decode's vLLM is SIGKILLed:
  through the cluster's router every stream completes, equal token for token to the plain
  server's answer, continued on the prefill worker (the only engine left) from the ids it had;
  through a router with ``--migration-limit 0``, every stream ends with an error event;
- the prefill's vLLM is SIGKILLed: requests sent after it are served whole by the decode,
  equal to the plain server; through a router with ``--no-role-fallback`` they fail;
- the same with SIGTERM of the (restarted) decode's launcher: it drains, and its streams move
  at once instead of holding its stop (with moves off they finish on it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import LEASE_S
from tests.support.cluster import (
    SERVED_NAME,
    START_TIMEOUT_S,
    Cluster,
    Plain,
    registered_records,
    registered_workers,
    running_cluster,
)
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.router_process import RouterProcess
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm

STREAMS = 8
MAX_TOKENS = 320
MID = 3
"""Content events every stream has received before the kill."""


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Its own cluster, not the session's: on the long-lived session cluster, the decode's
    # release to a prefill that had been SIGSTOPped and continued once timed out (UCX:
    # "asymmetric endpoint configuration", CI run 17), which a fresh cluster has not shown.
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("migration"),
                         instrument=True, lease_s=LEASE_S) as cluster:
        yield cluster


def vllm_group(url: str) -> int:
    """Process group of the vLLM server listening at ``url`` (its API server and engine)."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return os.getpgid(conn.pid)
    raise AssertionError(f"nothing listens at {url}")


@dataclass
class Streamed:
    """What one client saw."""

    text: str = ""
    events: int = 0
    ids: set[str] = field(default_factory=set)
    error: str | None = None
    finish: str | None = None
    done: bool = False


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, out: Streamed,
                  max_tokens: int = MAX_TOKENS) -> None:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                return
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]["message"]
                continue
            out.ids.add(event["id"])
            for choice in event.get("choices") or ():
                out.text += choice.get("text") or ""
                out.finish = choice.get("finish_reason") or out.finish
                if choice.get("text"):
                    out.events += 1


async def _signal_mid_stream(urls: list[str], prompts: list[str], fault: Callable[[], None]
                             ) -> tuple[list[list[Streamed]], bool]:
    """Streams of every prompt through each router; ``fault()`` once all are mid-way.
    Returns what each client saw, per router, and whether any stream had ended first."""
    seen = [[Streamed() for _ in prompts] for _ in urls]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        tasks = [asyncio.create_task(_stream(client, url, p, out))
                 for url, outs in zip(urls, seen, strict=True)
                 for p, out in zip(prompts, outs, strict=True)]
        every = [out for outs in seen for out in outs]
        deadline = time.monotonic() + 180
        while not all(out.events >= MID for out in every):
            assert time.monotonic() < deadline, [(o.events, o.error) for o in every]
            assert not any(t.done() for t in tasks), [
                (url, o.error, o.events, o.done) for url, outs in zip(urls, seen, strict=True)
                for o in outs if o.done or o.error]
            await asyncio.sleep(0.005)
        ended_first = any(out.finish or out.done for out in every)
        fault()
        await asyncio.gather(*tasks)
    return seen, ended_first


def _references(plain: Plain, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    """The plain server's greedy answers, requested together (float32: batching them changes
    no token, as the streams compared with them show)."""
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            resps = await asyncio.gather(*(client.post(plain.url + "/v1/completions", json={
                "model": SERVED_NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}) for p in prompts))
        for resp in resps:
            resp.raise_for_status()
        return [str(resp.json()["choices"][0]["text"]) for resp in resps]
    return asyncio.run(run())


def _moved_metrics(url: str) -> tuple[float, float]:
    samples = scrape(url)
    moved = sum(v for (name, _), v in samples.items()
                if name == "pdserve_router_migrations_total")
    refused = sum(v for (name, _), v in samples.items()
                  if name == "pdserve_router_migrations_refused_total")
    return moved, refused


async def _completed(url: str, prompts: list[str], max_tokens: int) -> list[Streamed]:
    seen = [Streamed() for _ in prompts]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        await asyncio.gather(*(_stream(client, url, p, out, max_tokens)
                               for p, out in zip(prompts, seen, strict=True)))
    return seen


def test_requests_waiting_on_a_stopped_prefill_are_served_elsewhere(
        pd: Cluster, plain: Plain, tiny_model_dir: Path) -> None:
    workers = registered_workers(pd)
    prompts = make_prompts(tiny_model_dir, [150, 200, 250, 300], seed=6, tag="sigstop")
    reference = _references(plain, prompts, 24)
    control = RouterProcess(redis_url=pd.redis_url, stall_timeout_s=0,
                            cluster_secret_file=str(pd.keyring_file)).start(timeout_s=60)
    group = vllm_group(workers["prefill"])
    stuck = Streamed()
    before = scrape(pd.url)

    async def run() -> list[Streamed]:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            waiting = asyncio.create_task(_stream(client, control.url, prompts[0], stuck, 24))
            served = await _completed(pd.url, prompts, 24)
            assert not waiting.done() and not stuck.text  # control: still stuck on it
            os.killpg(group, signal.SIGCONT)
            await waiting  # it goes on once the worker runs again
        return served

    os.killpg(group, signal.SIGSTOP)
    try:
        served = asyncio.run(run())
    finally:
        os.killpg(group, signal.SIGCONT)
        control.stop()
    for out, ref in zip(served, reference, strict=True):
        assert out.error is None and out.done and out.text == ref, out
    assert stuck.done and stuck.text == reference[0]
    after = scrape(pd.url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("pdserve_router_upstream_errors_total", role="prefill", kind="stall") >= 1
    assert grew("pdserve_router_paths_total", path="decode_only",
                reason="prefill_failed") == len(prompts)
    # the requests it was left holding are aborted (or their leases expire): nothing stays
    eventually(lambda: scrape(workers["prefill"]),
               lambda s: value(s, "vllm:num_requests_running") == 0 and
               value(s, "vllm:num_requests_waiting") == 0 and
               value(s, "vllm:kv_cache_usage_perc") == 0.0, timeout_s=LEASE_S + 30)


def test_killing_the_decode_mid_stream_costs_the_client_nothing(
        pd: Cluster, plain: Plain, tiny_model_dir: Path) -> None:
    workers = registered_workers(pd)
    prompts = make_prompts(tiny_model_dir, [120 + 20 * i for i in range(STREAMS)], seed=5,
                           tag="migration")
    reference = _references(plain, prompts)
    control = RouterProcess(redis_url=pd.redis_url, migration_limit=0,
                            cluster_secret_file=str(pd.keyring_file)).start(timeout_s=60)
    moved_before = _moved_metrics(pd.url)
    timeline_before = len(pd.router_timeline.read_text().splitlines())
    try:
        # warm: the new router loads its tokenizer on its first request, not while racing
        asyncio.run(_completed(control.url, prompts[:1], 2))
        group = vllm_group(workers["decode"])
        seen, ended_first = asyncio.run(_signal_mid_stream(
            [pd.url, control.url], prompts, lambda: os.killpg(group, signal.SIGKILL)))
        control_moves = _moved_metrics(control.url)
    finally:
        control.stop()
    assert not ended_first  # every stream was mid-way at the kill
    moved, controlled = seen
    for out, ref in zip(moved, reference, strict=True):
        assert out.error is None and out.done and out.finish == "length", out
        assert out.text == ref  # greedy: the same tokens as a plain engine, none twice
        assert len(out.ids) == 1  # one stream id across the move
    # Negative control: the same kill, with moves off, fails every stream it hit.
    # ... each with its choice ended "abort" before the error event (review finding 18)
    assert all(out.error is not None and out.finish == "abort" for out in controlled), controlled
    assert all(out.text and ref.startswith(out.text)
               for out, ref in zip(controlled, reference, strict=True))
    moved_after = _moved_metrics(pd.url)
    assert (moved_after[0] - moved_before[0], moved_after[1] - moved_before[1]) == (STREAMS, 0)
    assert control_moves == (0, STREAMS)
    # each move is in the request's timeline: from the decode, why, after how many tokens
    moves = [json.loads(line).get("moves") for line in
             pd.router_timeline.read_text().splitlines()[timeline_before:]]
    moves = [m for m in moves if m]
    assert len(moves) == STREAMS, moves
    for (move,) in moves:
        assert move["reason"] in ("protocol", "error_event", "truncated"), move
        assert move["sent_tokens"] >= MID and move["to"] != move["from"]
    prefill_id = next(r.worker_id for r in registered_records(pd) if r.role == "prefill")
    assert {move["to"] for (move,) in moves} == {prefill_id}  # the one engine left


def _serving(cluster: Cluster, role: str) -> str | None:
    """URL of the cluster's ``role`` worker when it is registered and answers, else None."""
    for record in registered_records(cluster):
        if record.role == role:
            try:
                if httpx.get(record.http_url + "/health", timeout=2).status_code == 200:
                    return record.http_url
            except httpx.HTTPError:
                return None
    return None


def test_killing_the_only_prefill_leaves_requests_served_by_the_decode(
        pd: Cluster, plain: Plain, tiny_model_dir: Path) -> None:
    """kill -9 of the prefill's vLLM: the requests sent after it are served whole by the
    decode (a complete vLLM), equal to the plain server's answers, whether the router still
    had the dead prefill in its view (connect refused: ``prefill_failed``) or saw it leave
    (``no_prefill_worker``). Control: a router with role fallback off fails them (5xx)."""
    decode = eventually(lambda: _serving(pd, "decode"), lambda u: u is not None,
                        timeout_s=START_TIMEOUT_S)  # the decode killed above, restarted
    assert decode is not None
    prefill = _serving(pd, "prefill")
    assert prefill is not None
    prompts = make_prompts(tiny_model_dir, [130, 160, 190, 220], seed=8, tag="kill-prefill")
    reference = _references(plain, prompts, 24)
    control = RouterProcess(redis_url=pd.redis_url, role_fallback=False,
                            cluster_secret_file=str(pd.keyring_file)).start(timeout_s=60)
    before = scrape(pd.url)
    try:
        asyncio.run(_completed(control.url, prompts[:1], 2))  # control: P/D works before
        os.killpg(vllm_group(prefill), signal.SIGKILL)
        served = asyncio.run(_completed(pd.url, prompts, 24))
        refused = [httpx.post(control.url + "/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": p, "max_tokens": 24, "temperature": 0})
            for p in prompts[:2]]
    finally:
        control.stop()
    for out, ref in zip(served, reference, strict=True):
        assert out.error is None and out.done and out.text == ref, out
    after = scrape(pd.url)
    fallbacks = sum(value(after, "pdserve_router_paths_total", path="decode_only", reason=why)
                    - value(before, "pdserve_router_paths_total", path="decode_only", reason=why)
                    for why in ("prefill_failed", "no_prefill_worker"))
    assert fallbacks == len(prompts), (before, after)
    assert all(r.status_code >= 500 for r in refused), [(r.status_code, r.text) for r in refused]


def test_a_sigtermed_decode_hands_over_its_streams(pd: Cluster, plain: Plain,
                                                  tiny_model_dir: Path) -> None:
    """SIGTERM of the decode's launcher under load: it leaves routing first, the router moves
    its streams to the prefill worker at their next event, and the worker stops once idle.
    Control: through a router with moves off, the streams finish on the draining decode."""
    url = eventually(lambda: _serving(pd, "decode"), lambda u: u is not None,
                     timeout_s=START_TIMEOUT_S)
    assert url is not None
    # the prefill killed above, restarted: the streams' only place to move to
    assert eventually(lambda: _serving(pd, "prefill"), lambda u: u is not None,
                      timeout_s=START_TIMEOUT_S)
    launcher = psutil.Process(next(
        c.pid for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == int(url.rsplit(":", 1)[1])
        and c.pid)).parent()
    assert launcher is not None and "worker" in " ".join(launcher.cmdline())
    prompts = make_prompts(tiny_model_dir, [110 + 20 * i for i in range(STREAMS)], seed=7,
                           tag="sigterm")
    reference = _references(plain, prompts)
    control = RouterProcess(redis_url=pd.redis_url, migration_limit=0,
                            cluster_secret_file=str(pd.keyring_file)).start(timeout_s=60)
    before = _drain_moves(pd.url)
    try:
        asyncio.run(_completed(control.url, prompts[:1], 2))  # warm its tokenizer
        seen, ended_first = asyncio.run(_signal_mid_stream(
            [pd.url, control.url], prompts, lambda: launcher.send_signal(signal.SIGTERM)))
        control_moves = _moved_metrics(control.url)
    finally:
        control.stop()
    assert not ended_first
    for outs in seen:
        for out, ref in zip(outs, reference, strict=True):
            assert out.error is None and out.done and out.text == ref, out
    assert _drain_moves(pd.url) - before == STREAMS  # handed over, not waited for
    assert control_moves == (0, 0)  # control: finished where they were
    launcher.wait(timeout=60)  # it stopped once idle (within its drain timeout)
    # the supervisor's replacement serves: the session cluster is whole again for its teardown
    assert eventually(lambda: _serving(pd, "decode"), lambda u: u not in (None, url),
                      timeout_s=START_TIMEOUT_S)


def _drain_moves(url: str) -> float:
    return value(scrape(url), "pdserve_router_migrations_total", reason="drain")
