"""The router's upstream HTTP/1.1 transport: httpx's client API over asyncio and httptools.

Every call to a worker goes through one ``httpx.AsyncClient``; this transport replaces its
default one (httpcore over h11, both pure Python), which cost the router more CPU per relayed
request than everything else it does (``python -m bench.router_overhead``). The client's API,
its exceptions and ``httpx.MockTransport`` in tests are unchanged: only the wire moves here.

- One request at a time per connection; idle connections are kept per ``host:port`` (the most
  recently used first) for ``keepalive_expiry`` seconds, at most ``max_keepalive_connections``
  of them, and at most ``max_connections`` are open at once (a request beyond waits up to the
  ``pool`` timeout: ``httpx.PoolTimeout``).
- Timeouts: ``connect`` (``httpx.ConnectTimeout``), and ``read``, the longest wait for the
  answer's head or for any part of its body (``httpx.ReadTimeout``). Writes go to the socket's
  buffer: ``write`` is not enforced (requests are small; the ``read`` timeout bounds the wait).
- Failures map to httpx's exceptions as httpcore's do, so the proxy's retry rules
  (``router.api.upstream``) read them the same: nobody listening -> ``httpx.ConnectError``; the
  peer closing before any byte of the answer (a kept-alive connection it was closing) ->
  ``httpx.RemoteProtocolError``; a reset -> ``httpx.ReadError``; an answer cut short ->
  ``httpx.RemoteProtocolError``; bytes that are not HTTP -> ``httpx.RemoteProtocolError``.
- The body is handed over as it arrives: all the chunks received since the last read in one
  piece. Reading pauses while more than ``HIGH_WATER`` bytes wait for a slow reader.
- A response closed before its end (a stream the client left) closes its connection: the worker
  sees the disconnect and aborts the request, as it did with httpcore.

``https://`` URLs and ``HEAD`` requests go to httpx's own transport.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import httptools
import httpx

HIGH_WATER = 256 * 1024
"""Bytes of a body waiting for its reader past which the socket stops being read (until the
reader takes them)."""

_TIMED_OUT = object()
_READ_TIMED_OUT = object()


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection and the answer being read on it."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.waiter: asyncio.Future[object] | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.closed = False
        self.error: Exception | None = None
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.received = False
        self.keep_alive = False
        self.framed = False
        """The answer has a length or is chunked (else its body ends when the peer closes)."""

    # -- asyncio -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # bytes nobody asked for: the connection cannot be reused
            self._fail(httpx.RemoteProtocolError("unexpected data on an idle connection"))
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.parser is not None and not self.complete and self.error is None:
            if exc is None and self.head_done and not self.framed:  # read to the close
                self.complete = True
            elif exc is not None:
                self.error = httpx.ReadError(str(exc) or repr(exc))
            elif not self.received:
                self.error = httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.")
            else:
                self.error = httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body")
        self._wake()

    # -- httptools -----------------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- the transport's side ------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def begin(self) -> None:
        """A new request is about to be written."""
        self._reset()
        self.error = None
        self.parser = httptools.HttpResponseParser(self)

    async def wait(self, timeout_s: float | None) -> bool:
        """Until the connection has news (False: ``timeout_s`` passed first)."""
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        try:
            return await wait_bounded(waiter, timeout_s)
        finally:
            self.waiter = None

    def take(self) -> bytes:
        """Everything of the body received so far."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


async def wait_bounded(waiter: asyncio.Future[object], timeout_s: float | None) -> bool:
    """Await ``waiter`` (woken by setting any result) for at most ``timeout_s`` (None: no
    bound); False when the bound passed first."""
    timer = None if timeout_s is None else asyncio.get_running_loop().call_later(
        timeout_s, _expire, waiter)
    try:
        return await waiter is not _TIMED_OUT
    finally:
        if timer is not None:
            timer.cancel()


def _expire(waiter: asyncio.Future[object]) -> None:
    if not waiter.done():
        waiter.set_result(_TIMED_OUT)


class Body(httpx.AsyncByteStream):
    """An answer's body as it arrives; closing it returns the connection to the pool (or closes
    it when the answer was not read to its end)."""

    def __init__(self, pool: UpstreamTransport, conn: _Connection,
                 read_timeout_s: float | None) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout_s = read_timeout_s
        self._closed = False
        self._last = time.monotonic()
        """When the body last gave its reader something (the read timeout counts from it)."""
        self._due: float | None = None
        self._read_due: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                raise httpx.ReadError("the connection closed")
            if not await conn.wait(self._read_timeout_s):
                raise httpx.ReadTimeout(f"no data for {self._read_timeout_s} s")

    # -- as a ``router.api.chunk_feed.ChunkFeed``: waited on by its reader, no task between --

    def take(self) -> bytes:
        """Everything of the body received and not taken yet (``b""``: nothing)."""
        if not self._conn.chunks:
            return b""
        self._last = time.monotonic()
        return self._conn.take()

    def ended(self) -> bool:
        """Whether the body ended after everything was taken; raises its failure once all
        that came before it was taken."""
        conn = self._conn
        if conn.chunks:
            return False
        if conn.complete:
            return True
        if conn.error is not None:
            raise conn.error
        if conn.closed:
            raise httpx.ReadError("the connection closed")
        return False

    async def wait(self, timeout_s: float | None) -> bool:
        """Until the body has news or :meth:`wake` is called; False when ``timeout_s`` passed
        first. Past the read timeout with nothing received: ``httpx.ReadTimeout``.

        One timer serves every wait of a stream (a stream waits once per token): it is moved
        only when a wait needs it earlier; firing while nobody waits, it is dropped and the
        next wait arms it; firing before the current wait's deadline, it re-arms for it."""
        conn = self._conn
        if conn.chunks or conn.complete or conn.error is not None or conn.closed:
            return True
        now = time.monotonic()
        read_s = self._read_timeout_s
        self._read_due = None if read_s is None else self._last + read_s
        if self._read_due is not None and self._read_due <= now:
            raise httpx.ReadTimeout(f"no data for {read_s} s")
        self._due = None if timeout_s is None else now + timeout_s
        self._arm(now)
        loop = asyncio.get_running_loop()
        waiter = conn.waiter = loop.create_future()
        try:
            result = await waiter
        finally:
            conn.waiter = None
        if result is _READ_TIMED_OUT:
            raise httpx.ReadTimeout(f"no data for {read_s} s")
        return result is not _TIMED_OUT

    def _arm(self, now: float) -> None:
        """Have the timer fire by the current wait's earliest deadline."""
        due, read_due = self._due, self._read_due
        first = read_due if due is None or (read_due is not None and read_due < due) else due
        if first is None:
            return
        if self._timer is not None:
            if self._timer_at <= first:
                return  # it fires first and re-arms for what is due then
            self._timer.cancel()
        self._timer_at = first
        self._timer = asyncio.get_running_loop().call_later(max(0.0, first - now), self._fire)

    def _fire(self) -> None:
        self._timer = None
        waiter = self._conn.waiter
        if waiter is None or waiter.done() or self._closed:
            return  # nobody waits: the next wait arms it again
        now = time.monotonic()
        if self._read_due is not None and now >= self._read_due:
            waiter.set_result(_READ_TIMED_OUT)
        elif self._due is not None and now >= self._due:
            waiter.set_result(_TIMED_OUT)
        else:
            self._arm(now)

    def wake(self) -> None:
        """End a pending :meth:`wait` now."""
        self._conn._wake()

    def stop(self) -> None:
        """No more waits: the timer goes (closing the answer, :meth:`aclose`, ends the read)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def aclose(self) -> None:
        self.stop()
        if not self._closed:
            self._closed = True
            self._pool.release(self._conn)


class UpstreamTransport(httpx.AsyncBaseTransport):
    """See the module docstring."""

    def __init__(self, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits()
        self._max_connections = limits.max_connections
        self._max_idle = limits.max_keepalive_connections
        self._expiry_s = limits.keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._fallback = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)

    # -- the pool ------------------------------------------------------------------------------

    def _idle_count(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or (self._expiry_s is not None and now - conn.idle_since
                               > self._expiry_s):
                self._drop(conn)
                continue
            conn.reused = True
            return conn
        return None

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        """A connection or a slot came free: the longest waiting request may take it."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # one that gave up is cancelled
                waiter.set_result(None)
                return

    async def _acquire(self, key: tuple[str, int], connect_s: float | None,
                       pool_s: float | None) -> _Connection:
        conn = self._take_idle(key)
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        deadline = None if pool_s is None else loop.time() + pool_s
        while self._max_connections is not None and self._open >= self._max_connections:
            if not self._evict_idle():
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiting.append(waiter)
                try:
                    await asyncio.wait_for(waiter, None if deadline is None
                                           else max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise httpx.PoolTimeout("no connection free within the pool timeout"
                                            ) from None
                finally:
                    if not waiter.done():
                        waiter.cancel()
            conn = self._take_idle(key)
            if conn is not None:
                return conn
        self._open += 1
        try:
            _, opened = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(key), key[0], key[1]), connect_s)
        except TimeoutError:
            self._drop_slot()
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            self._drop_slot()
            raise httpx.ConnectError(str(exc) or repr(exc)) from exc
        except BaseException:
            self._drop_slot()
            raise
        return opened

    def _drop_slot(self) -> None:
        self._open -= 1
        self._wake_one()

    def _evict_idle(self) -> bool:
        """Close the oldest idle connection to any host to make room (True: one was)."""
        oldest: _Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        self._idle[oldest.key].remove(oldest)
        self._drop(oldest)
        return True

    def release(self, conn: _Connection) -> None:
        """An answer is done with ``conn``: back to the pool when it can carry another."""
        reusable = conn.complete and conn.keep_alive and not conn.closed and \
            conn.error is None and not conn.chunks and not conn.paused
        conn.parser = None
        if not reusable or (self._max_idle is not None and self._idle_count() >= self._max_idle):
            self._drop(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    # -- httpx ---------------------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http" or request.method == "HEAD":
            return await self._fallback.handle_async_request(request)
        head = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            if name.lower() not in (b"content-length", b"transfer-encoding"):
                head += [name, b": ", value, b"\r\n"]
        body = await request.aread()
        if body or request.method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        return await self._send((url.host, url.port or 80), b"".join(head) + body,
                                request.extensions.get("timeout", {}))

    async def post(self, url: httpx.URL, content: bytes, headers: Mapping[str, str],
                   timeout: Mapping[str, float | None]) -> httpx.Response:
        """``POST content`` to ``url`` with ``headers`` (``host`` and ``content-length`` are
        added): :meth:`handle_async_request` without building an ``httpx.Request``, whose
        header normalisation cost a relayed request more than writing it. ``timeout``:
        httpx's keys (``connect``, ``read``, ``pool``)."""
        if url.scheme != "http":
            return await self.handle_async_request(httpx.Request(
                "POST", url, content=content, headers=headers,
                extensions={"timeout": dict(timeout)}))
        lines = [f"POST {url.raw_path.decode('ascii')} HTTP/1.1\r\n"
                 f"host: {url.netloc.decode('ascii')}\r\n"]
        for name, value in headers.items():
            if name.lower() not in ("host", "content-length", "transfer-encoding"):
                lines.append(f"{name}: {value}\r\n")
        lines.append(f"content-length: {len(content)}\r\n\r\n")
        return await self._send((url.host, url.port or 80),
                                "".join(lines).encode("latin-1") + content, timeout)

    async def _send(self, key: tuple[str, int], message: bytes,
                    timeouts: Mapping[str, float | None]) -> httpx.Response:
        """Write ``message`` (a whole request) on a connection to ``key``; its answer's head."""
        conn = await self._acquire(key, timeouts.get("connect"), timeouts.get("pool"))
        try:
            return await self._exchange(conn, message, timeouts.get("read"))
        except BaseException:
            conn.parser = None
            self._drop(conn)
            raise

    async def _exchange(self, conn: _Connection, message: bytes,
                        read_s: float | None) -> httpx.Response:
        conn.begin()
        assert conn.transport is not None
        if conn.closed:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        conn.transport.write(message)
        while not conn.head_done:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.")
            if not await conn.wait(read_s):
                raise httpx.ReadTimeout(f"no answer within {read_s} s")
        return httpx.Response(conn.status, headers=conn.headers,
                              stream=Body(self, conn, read_s),
                              extensions={"http_version": b"HTTP/1.1",
                                          "reason_phrase": conn.reason.strip()})

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        await self._fallback.aclose()
