"""A lean open-loop HTTP/1.1 client for latency differences of a millisecond or less.

``bench.client`` (httpx) costs the client's core more per request than a fast router does, and
its own queueing would hide the difference being measured. This one is raw asyncio: a pool of
keep-alive connections, requests pre-encoded, responses read incrementally with only the framing
parsed (``content-length`` or chunked) and one search per body chunk for generated text. Each
request is sent at its scheduled time whatever came before (open loop).

Per request it records, from its send: the first generated text (``ttft_s``: the first SSE
event with a non-empty ``text`` or ``content``; a whole answer's end) and the last byte
(``ttlb_s``). A request is ``ok`` when it answered 200 with every expected token: a stream
that ends with ``[DONE]`` after ``tokens`` events with text, or a whole JSON answer.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

_TEXT = re.compile(rb'"(?:text|content)":"[^"]')
"""An event carrying generated text (vLLM writes compact JSON)."""
_DONE = b"data: [DONE]\n\n"


@dataclass
class Timing:
    """One request's outcome; times in seconds."""

    scheduled_s: float
    """When it was due, after the run's start."""
    lag_s: float = math.nan
    """How late the client sent it."""
    ttft_s: float = math.nan
    ttlb_s: float = math.nan
    status: int = 0
    error: str = ""
    """Empty when ok; else what went wrong (``http_503``, ``incomplete``, ``timeout``...)."""

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200


class _Response:
    """Incremental reader of one response's status, framing and body."""

    def __init__(self, timing: Timing, sent: float, stream: bool, tokens: int) -> None:
        self.timing = timing
        self.sent = sent
        self.stream = stream
        self.tokens = tokens
        self.buf = bytearray()
        self.headed = False
        self.chunked = False
        self.length = 0
        self.body: list[bytes] = []
        self._tail = b""
        self.done = asyncio.get_running_loop().create_future()

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        if not self.headed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1").lower().split("\r\n")
            self.timing.status = int(head[0].split(" ", 2)[1])
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name == "content-length":
                    self.length = int(value)
                elif name == "transfer-encoding" and "chunked" in value:
                    self.chunked = True
            del self.buf[:end + 4]
            self.headed = True
        if self.chunked:
            self._chunks(now)
        elif len(self.buf) >= self.length:
            self.body.append(bytes(self.buf[:self.length]))
            del self.buf[:self.length]
            self._text(self.body[-1], now)
            self._end(now)

    def _chunks(self, now: float) -> None:
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                return
            size = int(bytes(buf[:eol]).split(b";")[0], 16)
            if size == 0:
                if len(buf) < eol + 4:
                    return
                del buf[:eol + 4]
                self._end(now)
                return
            if len(buf) < eol + 2 + size + 2:
                return
            data = bytes(buf[eol + 2:eol + 2 + size])
            del buf[:eol + 2 + size + 2]
            self.body.append(data)
            self._text(data, now)

    def _text(self, data: bytes, now: float) -> None:
        if not self.stream or not math.isnan(self.timing.ttft_s):
            return
        if _TEXT.search(self._tail + data):  # an event may straddle two chunks
            self.timing.ttft_s = now - self.sent
        self._tail = data[-16:]

    def _end(self, now: float) -> None:
        t = self.timing
        t.ttlb_s = now - self.sent
        if t.status != 200:
            t.error = f"http_{t.status}"
        elif self.stream:
            body = b"".join(self.body)
            events = len(_TEXT.findall(body))
            if not body.endswith(_DONE) or events != self.tokens:
                t.error = f"incomplete ({events}/{self.tokens} tokens)"
        else:
            t.ttft_s = t.ttlb_s
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, error: str) -> None:
        if not self.timing.error:
            self.timing.error = error
        if not self.done.done():
            self.done.set_result(None)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.response is not None:
            self.response.feed(data, time.perf_counter())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.fail("connection_lost")


class LeanClient:
    """Keep-alive connections to one ``host:port``; :meth:`run` replays a schedule."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._idle: list[_Connection] = []
        self._all: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(
            _Connection, self.host, self.port)
        self._all.append(conn)
        return conn

    async def _one(self, request: bytes, timing: Timing, stream: bool, tokens: int,
                   t0: float) -> None:
        sent = time.perf_counter()
        timing.lag_s = sent - t0 - timing.scheduled_s
        try:
            conn = await self._connection()
        except OSError as exc:
            timing.error = f"connect: {exc}"
            return
        response = conn.response = _Response(timing, sent, stream, tokens)
        assert conn.transport is not None
        conn.transport.write(request)
        try:
            await asyncio.wait_for(asyncio.shield(response.done), self.timeout_s)
        except TimeoutError:
            response.fail("timeout")
            conn.transport.close()
            return
        conn.response = None
        if timing.error or conn.closed:
            conn.transport.close()
        else:
            self._idle.append(conn)

    async def run(self, requests: Sequence[bytes], offsets_s: Sequence[float], *, stream: bool,
                  tokens: int) -> list[Timing]:
        """Send ``requests[i]`` (a whole HTTP/1.1 request) ``offsets_s[i]`` seconds after the
        start; wait for every answer."""
        timings = [Timing(at) for at in offsets_s]
        tasks = []
        t0 = time.perf_counter()
        for request, timing in zip(requests, timings, strict=True):
            delay = timing.scheduled_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self._one(request, timing, stream, tokens, t0)))
        await asyncio.gather(*tasks)
        return timings

    def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()
        self._all.clear()
        self._idle.clear()


def http_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """One POST of a JSON ``body`` on a kept-alive connection."""
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
