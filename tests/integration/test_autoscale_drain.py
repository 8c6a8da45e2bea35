"""The Kubernetes preStop drain against a real Redis registry and a worker's HTTP endpoints.

The worker here is a small HTTP server with vLLM's metric names (a real vLLM worker needs
~50 s of this machine per start; the drain reads only ``/metrics`` and ``/health``). At each
scrape it records the registry's draining set, so the test sees the order of the steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

from router.autoscale.drain import DrainConfig, own_worker_ids, prestop, ready
from router.state.registry import WorkerRecord, WorkerRegistry
from serve.redis_server import RedisServer

HOST = "pdserve-decode-7f9c-x2x"
PREFIX = "draintest"


@dataclass
class Worker:
    """Busy for ``busy_scrapes`` scrapes, then idle; remembers the draining set per scrape."""

    redis_url: str
    busy_scrapes: int = 2
    draining_at_scrape: list[set[str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def metrics(self) -> str:
        r = redis.Redis.from_url(self.redis_url)
        try:
            members = r.smembers(f"{PREFIX}:draining")
            self.draining_at_scrape.append(
                {m.decode() if isinstance(m, bytes) else str(m) for m in members})
        finally:
            r.close()
        running = 1 if len(self.draining_at_scrape) <= self.busy_scrapes else 0
        return (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                'vllm:num_requests_waiting{model_name="m"} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="m"}} {0.25 * running}\n')

    def start(self) -> Worker:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = (worker.metrics() if self.path == "/metrics" else "ok").encode()
                self.send_response(200 if self.path in ("/metrics", "/health") else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def record(worker_id: str, url: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role="decode", model="m", model_path="/m",
                        http_url=url, engine_id=worker_id, ucx_address="",
                        started_at=time.time(), max_model_len=2048)


@pytest.fixture()
def worker(redis_server: RedisServer) -> Iterator[Worker]:
    w = Worker(redis_server.url).start()
    yield w
    w.stop()


async def _register(url: str, ids: list[str], worker_url: str) -> None:
    registry = WorkerRegistry(url, prefix=PREFIX, ttl_s=60)
    try:
        for worker_id in ids:
            await registry.register(record(worker_id, worker_url))
    finally:
        await registry.close()


def test_own_worker_ids_match_the_hostname_exactly() -> None:
    ids = [f"decode-{HOST}-0a1b2c3d", f"prefill-{HOST}-99999999", f"decode-{HOST}2-0a1b2c3d",
           "decode-pdserve-decode-7f9c-0a1b2c3d"]
    assert own_worker_ids(ids, HOST) == ids[:2]


def test_prestop_deregisters_from_routing_before_draining(
        redis_server: RedisServer, worker: Worker, tmp_path: Path) -> None:
    mine, other = f"decode-{HOST}-0a1b2c3d", "decode-pdserve-decode-other-12345678"
    asyncio.run(_register(redis_server.url, [mine, other], worker.url))
    cfg = DrainConfig(worker_url=worker.url, redis_url=redis_server.url, prefix=PREFIX,
                      hostname=HOST, marker=tmp_path / "draining", timeout_s=30.0,
                      poll_s=0.05)
    assert ready(cfg)  # healthy, not draining
    assert asyncio.run(prestop(cfg)) is True
    # every scrape of the drain already saw this pod (and only it) out of routing
    assert worker.draining_at_scrape and all(
        seen == {mine} for seen in worker.draining_at_scrape)
    # it waited for the two busy scrapes, then two idle ones
    assert len(worker.draining_at_scrape) == 4
    assert not ready(cfg)  # the pod reports not-ready from the start of the drain on
    (tmp_path / "draining").unlink()
    assert ready(cfg)  # negative control: the marker alone made it not-ready


def test_prestop_gives_up_at_the_timeout(
        redis_server: RedisServer, worker: Worker, tmp_path: Path) -> None:
    worker.busy_scrapes = 10**6
    cfg = DrainConfig(worker_url=worker.url, redis_url=redis_server.url, prefix=PREFIX,
                      hostname="nobody", marker=tmp_path / "draining", timeout_s=0.5,
                      poll_s=0.05)
    assert asyncio.run(prestop(cfg)) is False
    assert not ready(cfg)
