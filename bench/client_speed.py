"""Client throughput benchmark: open-loop requests/s from one core against a fast local endpoint.

    python -m bench.client_speed --rate 600 --requests 6000

A minimal OpenAI-style SSE server (raw asyncio, HTTP/1.1 keep-alive, a canned stream of
``--tokens`` chunks per request) runs in a child process pinned to one core; the client runs
pinned to another and replays a constant-rate schedule through :func:`bench.client.run_open_loop`.
Reports the achieved send rate, completions/s and schedule lag percentiles. Target: >= 500 req/s
with schedule lag p99 < 5 ms.

The fake server also serves the client tests: a prompt containing ``FAIL500`` gets a 500,
``HANG`` never gets an answer, ``ERREVENT`` gets an error event mid-stream, ``NOTEXT`` streams
only a text-less finish chunk whose usage counts its ``max_tokens`` (tokens that decode to no
text), ``NOTOKEN`` the same finish chunk with no token counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.metrics import percentile

logger = logging.getLogger(__name__)

_MODELS = json.dumps({"object": "list", "data": [
    {"id": "fake", "object": "model", "root": None, "max_model_len": 4096}]}).encode()


def _sse(tokens: int, prompt_tokens: int, *, with_text: bool = True) -> bytes:
    """A completion stream of ``tokens`` tokens, one text chunk each, then the usage event;
    without ``with_text``, one text-less finish chunk in their place (tokens that decode to
    no text)."""
    if with_text:
        choices = [{"index": 0, "text": f" t{i}", "finish_reason": None} for i in range(tokens)]
    else:
        choices = [{"index": 0, "text": "", "finish_reason": "length"}]
    events: list[dict[str, Any]] = [
        {"id": "x", "object": "text_completion", "choices": [c]} for c in choices]
    events.append({"id": "x", "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                       "completion_tokens": tokens}})
    return b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events) \
        + b"data: [DONE]\n\n"


def _response(status: str, ctype: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
            "connection: keep-alive\r\n\r\n").encode() + body


class _Proto(asyncio.Protocol):
    def __init__(self, tokens: int) -> None:
        self.buf = b""
        self.tokens = tokens
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v.strip())
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4: head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            self._handle(head.split(" ", 2), body)

    def _handle(self, request_line: list[str], body: bytes) -> None:
        assert self.transport is not None
        if request_line[0] == "GET":
            self.transport.write(_response("200 OK", "application/json", _MODELS))
            return
        if b"HANG" in body:
            return
        if b"FAIL500" in body:
            err = b'{"error": {"message": "boom", "type": "server_error", "code": "boom"}}'
            self.transport.write(_response("500 Internal Server Error", "application/json", err))
            return
        if b"ERREVENT" in body:
            payload = (b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
                       b'data: {"error": {"message": "worker died", "code": "x"}}\n\n')
            self.transport.write(_response("200 OK", "text/event-stream", payload))
            return
        tokens = self.tokens
        with contextlib.suppress(ValueError):
            tokens = int(json.loads(body).get("max_tokens", tokens))
        if b"NOTEXT" in body or b"NOTOKEN" in body:
            payload = _sse(0 if b"NOTOKEN" in body else tokens, 8, with_text=False)
            self.transport.write(_response("200 OK", "text/event-stream", payload))
            return
        self.transport.write(_response("200 OK", "text/event-stream", _sse(tokens, 8)))


def serve_fake(port: int, tokens: int = 4, cpu: int | None = None) -> None:
    """Run the fake SSE server on 127.0.0.1:``port`` forever (child-process entry point)."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Proto(tokens), "127.0.0.1", port,
                                          backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def fake_server(tokens: int = 4, cpu: int | None = None) -> Iterator[str]:
    """Start the fake server in a child process; yields its base URL."""
    port = _free_port()
    proc = mp.get_context("spawn").Process(target=serve_fake, args=(port, tokens, cpu),
                                           daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or not proc.is_alive():
                    raise RuntimeError("fake server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.join(10)


def measure(url: str, rate: float, n: int, tokens: int) -> dict[str, Any]:
    """Send ``n`` requests at a constant ``rate``; returns throughput and lag stats."""
    from bench.client import ClientConfig, RequestSpec, run_open_loop

    specs = [RequestSpec(i, i / rate, "hello world", 2, tokens) for i in range(n)]
    cfg = ClientConfig(url=url, model="fake", timeout_s=30.0)
    t = time.perf_counter()
    run = asyncio.run(run_open_loop(specs, cfg))
    wall = time.perf_counter() - t
    lags = np.array([r.lag_s for r in run.results])
    sent_span = max(r.sent_s for r in run.results) - min(r.sent_s for r in run.results)
    ok = sum(r.ok for r in run.results)
    return {"target_rate_rps": rate, "requests": n, "completed": ok,
            "send_rate_rps": (n - 1) / sent_span if sent_span > 0 else None,
            "completion_rate_rps": ok / wall, "wall_s": wall,
            "lag_p50_ms": percentile(lags, 50) * 1e3,
            "lag_p99_ms": percentile(lags, 99) * 1e3,
            "lag_max_ms": float(lags.max() * 1e3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.client_speed",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, action="append",
                    help="target req/s; repeatable (default 500, 750, 1000)")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--tokens", type=int, default=4, help="streamed chunks per response")
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--server-cpu", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.client_cpu})
    rows = []
    with fake_server(args.tokens, cpu=args.server_cpu) as url:
        measure(url, 200, 400, args.tokens)  # warm-up: imports, connection pool
        for rate in args.rate or [500.0, 750.0, 1000.0]:
            res = measure(url, rate, args.requests, args.tokens)
            rows.append(res)
            logger.info("%s", json.dumps(res))
    print("| target req/s | sent req/s | completed req/s | lag p50 ms | lag p99 ms | "
          "lag max ms | completed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target_rate_rps']:.0f} | {r['send_rate_rps']:.1f} | "
              f"{r['completion_rate_rps']:.1f} | {r['lag_p50_ms']:.2f} | {r['lag_p99_ms']:.2f} | "
              f"{r['lag_max_ms']:.2f} | {r['completed']}/{r['requests']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
