"""Membership that matches reality: real router, real Redis, fake workers.

A missed heartbeat does not evict a worker that still answers; a refused connection evicts
at once; an evicted worker comes back when it answers again; a deregistered one leaves at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from router.state.registry import WorkerRegistry
from serve.redis_server import RedisServer
from tests.fakes.fake_worker import FakeWorker, build_tiny_tokenizer

PREFIX = "membership"
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 4}


def _ids(client: httpx.Client, url: str) -> set[str]:
    return {w["worker_id"] for w in client.get(url + "/workers").json()["data"]}


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _registry_call(url: str, ttl_s: float, call: Callable[[WorkerRegistry], object]) -> None:
    async def go() -> None:
        reg = WorkerRegistry(url, prefix=PREFIX, ttl_s=ttl_s)
        try:
            await call(reg)  # type: ignore[misc]
        finally:
            await reg.close()

    asyncio.run(go())


@pytest.fixture
def own(redis_server: RedisServer, tmp_path: Path) -> Iterator[dict[str, FakeWorker]]:
    """p0, p1, d0 registered for 10 minutes under this module's prefix."""
    tok = str(build_tiny_tokenizer(tmp_path / "tok"))
    fakes = {wid: FakeWorker(wid, role, model_path=tok).start()  # type: ignore[arg-type]
             for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))}
    for f in fakes.values():
        _registry_call(redis_server.url, 600, lambda reg, f=f: reg.register(f.record()))
    yield fakes
    for f in fakes.values():
        f.stop()
    for wid in fakes:
        _registry_call(redis_server.url, 600, lambda reg, wid=wid: reg.deregister(wid))


def test_refused_connection_evicts_and_answering_again_readmits(
        own: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(redis_prefix=PREFIX)
    assert _ids(client, url) == {"p0", "p1", "d0"}
    port = own["p0"]._server.port  # type: ignore[union-attr]
    own["p0"].stop()
    for _ in range(2):  # round robin: one of these two is sent to p0 first
        assert client.post(url + "/v1/completions", json=BODY).status_code == 200
    # Evicted on the refused connection, long before its registry key (10 min) expires.
    assert _ids(client, url) == {"p1", "d0"}
    own["p0"].start(port)
    _until(lambda: _ids(client, url) == {"p0", "p1", "d0"})


def test_missed_heartbeats_keep_an_answering_worker_and_tombstones_remove(
        redis_server: RedisServer, own: dict[str, FakeWorker],
        start_router: Callable[..., str], client: httpx.Client) -> None:
    url = start_router(redis_prefix=PREFIX)
    d1 = FakeWorker("d1", "decode", model_path=own["d0"].model_path).start()
    try:
        # Registered with a 0.3 s TTL and never heartbeated: the key expires at once.
        _registry_call(redis_server.url, 0.3, lambda reg: reg.register(d1.record()))
        _until(lambda: "d1" in _ids(client, url))

        async def expired(reg: WorkerRegistry) -> None:
            while any(r.worker_id == "d1" for r in await reg.list()):
                await asyncio.sleep(0.05)

        _registry_call(redis_server.url, 600, expired)
        time.sleep(1.0)  # several refreshes after the key is gone
        assert "d1" in _ids(client, url)  # it still answers: kept
        own["d0"].mode = "error_500"  # only d1 can serve decodes now
        assert client.post(url + "/v1/completions", json=BODY).status_code == 200
        assert len(d1.requests) == 1

        d1.stop()  # no longer answers: gone after the next probe
        _until(lambda: "d1" not in _ids(client, url))
    finally:
        d1.stop()

    # Negative control: a deregistered worker leaves at once although it still answers.
    _registry_call(redis_server.url, 600, lambda reg: reg.deregister("p1"))
    _until(lambda: "p1" not in _ids(client, url), timeout_s=3.0)
    time.sleep(1.0)
    assert "p1" not in _ids(client, url)
