"""Helpers of the router tests that run the real router in front of fake workers."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from router.state.registry import WorkerRecord, WorkerRegistry
from tests.fakes.fake_worker import FakeWorker

PREFIX = "proxytest"
MAX_MODEL_LEN = 64


def stream_request(chat: bool) -> tuple[str, dict[str, Any]]:
    """Path and body of a streamed request for the fakes' model ``tiny`` asking for usage."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
        return "/v1/chat/completions", body
    body["prompt"] = "hello"
    return "/v1/completions", body


def _with_registry(url: str, prefix: str,
                   use: Callable[[WorkerRegistry], Awaitable[None]]) -> None:
    async def go() -> None:
        reg = WorkerRegistry(url, prefix=prefix, ttl_s=600)
        try:
            await use(reg)
        finally:
            await reg.close()

    asyncio.run(go())


def register(url: str, records: list[WorkerRecord], prefix: str = PREFIX) -> None:
    """Register ``records`` in the Redis at ``url`` (10-minute TTL)."""
    async def use(reg: WorkerRegistry) -> None:
        for rec in records:
            await reg.register(rec)

    _with_registry(url, prefix, use)


def deregister(url: str, worker_ids: list[str], prefix: str = PREFIX) -> None:
    """Remove ``worker_ids`` from the Redis registry at ``url`` (tests that add workers of
    their own must not leave them to the next test)."""
    async def use(reg: WorkerRegistry) -> None:
        for worker_id in worker_ids:
            await reg.deregister(worker_id)

    _with_registry(url, prefix, use)


def wait_healthy(url: str, timeout_s: float = 15.0,
                 proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll the router's /health until 200 (failing at once if its process ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False) as c:
        while True:
            assert proc is None or proc.poll() is None, f"router exited ({proc.returncode})"
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router did not become healthy"
            time.sleep(0.02)


def calls(fakes: dict[str, FakeWorker]) -> dict[str, int]:
    """Requests each fake worker received."""
    return {wid: len(f.requests) for wid, f in fakes.items()}


def wait_metrics(client: httpx.Client, url: str, lines: list[str],
                 timeout_s: float = 15.0) -> None:
    """Poll ``url``/metrics until every line of ``lines`` appears."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get(url + "/metrics").text
        missing = [line for line in lines if line not in text]
        if not missing:
            return
        assert time.monotonic() < deadline, f"metrics never showed {missing}"
        time.sleep(0.05)
