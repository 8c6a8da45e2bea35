"""Slow clients and too many connections (security review finding 12).

Real router processes (``router.main.serve``: uvicorn with ``router.http_protocol``), real
Redis, fake workers; clients are raw sockets, so a request can stop half-way. The router under
test has 1 s deadlines on the request head and body; the control router the same settings with
both deadlines off. Every wait is for a condition, bounded by ``BOUND_S`` (generous: a loaded
2-core machine); nothing asserts how fast a deadline fired beyond that bound.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve.redis_server import RedisServer
from tests.fakes.fake_worker import FakeWorker
from tests.support.metrics import scrape, value
from tests.support.router import PREFIX, calls
from tests.support.router_process import RouterProcess
from tests.support.waiting import eventually

DEADLINE_S = 1.0
"""--header-timeout-s and --body-timeout-s of the router under test."""
BOUND_S = 15.0
"""Longest any test waits for what it expects."""
BODY = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 6}).encode()
HEALTH = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
CLOSES = "pdserve_router_connections_closed_total"


def _router(redis_url: str, **settings: object) -> RouterProcess:
    return RouterProcess(redis_url=redis_url, redis_prefix=PREFIX, refresh_interval_s=0.1,
                         policy="round_robin", **settings)


@pytest.fixture(scope="module")
def routers(redis_server: RedisServer,
            workers: dict[str, FakeWorker]) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    """(strict: 1 s head and body deadlines, control: both off), in front of the fakes."""
    strict = _router(redis_server.url, header_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S)
    control = _router(redis_server.url, header_timeout_s=0, body_timeout_s=0)
    try:
        strict.start()
        control.start()
        yield strict, control
    finally:
        strict.stop()
        control.stop()


def _connect(router: RouterProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port), timeout=BOUND_S)


def _closes(router: RouterProcess, reason: str) -> float:
    return value(scrape(router.url), CLOSES, reason=reason)


def _wait_closed(sock: socket.socket, bound_s: float) -> tuple[bool, bytes]:
    """Read until the peer closes: (True, all it sent); (False, all it sent) at ``bound_s``."""
    deadline = time.monotonic() + bound_s
    got = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def _is_open(sock: socket.socket) -> bool:
    """Whether the peer has neither closed nor sent anything (does not block)."""
    sock.settimeout(0)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.settimeout(BOUND_S)


class _Reader:
    """Reads from a socket up to a delimiter or a length (what one response needs)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"connection closed inside a response: {self.data[:200]!r}"
        self.data += chunk

    def until(self, delimiter: bytes) -> bytes:
        while delimiter not in self.data:
            self._more()
        out, _, self.data = self.data.partition(delimiter)
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.data) < n:
            self._more()
        out, self.data = self.data[:n], self.data[n:]
        return out


def _assert_still_open(sock: socket.socket) -> None:
    """A control's connection: open now (after the strict router closed its twin), and still
    open two deadlines later, with nothing sent to it."""
    assert _is_open(sock)
    assert _wait_closed(sock, 2 * DEADLINE_S) == (False, b"")


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked): status, headers (lower-cased), body.
    Nothing after it is read (kept-alive connections are reused)."""
    sock.settimeout(BOUND_S)
    reader = _Reader(sock)
    status_line, *lines = reader.until(b"\r\n\r\n").decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int(reader.until(b"\r\n"), 16):
            body += reader.exactly(size)
            reader.exactly(2)
        reader.until(b"\r\n")  # no trailers
    else:
        body = reader.exactly(int(headers["content-length"]))
    assert reader.data == b"", "the router sent more than one response"
    return int(status_line.split()[1]), headers, body


class Trickle:
    """Sends ``data`` a byte at a time, ``interval_s`` apart, from a thread, until it runs out,
    the peer closes or :meth:`stop` (a slowloris body: every byte arrives in time for uvicorn's
    keep-alive timer, which only ever sees a busy connection)."""

    def __init__(self, sock: socket.socket, data: bytes, interval_s: float = 0.2) -> None:
        self._sock, self._data, self._interval_s = sock, data, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in range(len(self._data)):
            if self._stopped.wait(self._interval_s):
                return
            try:
                self._sock.send(self._data[i:i + 1])
            except OSError:  # closed by the router
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=BOUND_S)


def test_a_connection_without_a_complete_head_is_closed_unanswered_and_counted(
        routers: tuple[RouterProcess, RouterProcess]) -> None:
    """A partial head (and a connection that sends nothing) is closed without an answer once
    the header deadline passes, and counted. Negative control: the same partial head on the
    router without the deadline is still open after that wait and two deadlines more, and
    finishing it gets an answer."""
    strict, control = routers
    before = _closes(strict, "head_timeout")
    partial = b"GET /health HTTP/1.1\r\nHost: router\r\nX-Slow: "
    with _connect(strict) as late, _connect(strict) as idle, _connect(control) as kept:
        late.sendall(partial)
        kept.sendall(partial)
        assert _wait_closed(late, BOUND_S) == (True, b"")
        assert _wait_closed(idle, BOUND_S) == (True, b"")
        _assert_still_open(kept)
        kept.sendall(b"1\r\n\r\n")
        assert _read_response(kept)[0] == 200
    eventually(lambda: _closes(strict, "head_timeout"), lambda n: n >= before + 2,
               timeout_s=BOUND_S)
    assert _closes(control, "head_timeout") == 0


def test_a_kept_alive_connection_gets_its_deadline_from_the_next_requests_first_byte(
        routers: tuple[RouterProcess, RouterProcess]) -> None:
    """A kept-alive connection serves requests for longer than the deadline (each head is timed
    from its own first byte, not from the accept); then a partial next head closes it (before
    uvicorn's 5 s keep-alive timer could: that timer stops at the first byte) and is counted.
    Negative control: the same on the router without the deadline stays open."""
    strict, control = routers
    before = _closes(strict, "head_timeout")
    with _connect(strict) as conn, _connect(control) as kept:
        served_until = time.monotonic() + 2 * DEADLINE_S
        served = 0
        while time.monotonic() < served_until or served < 3:
            for sock in (conn, kept):
                sock.sendall(HEALTH)
                assert _read_response(sock)[0] == 200
            served += 1
            time.sleep(DEADLINE_S / 4)  # idle between requests: the keep-alive timer's time
        for sock in (conn, kept):
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _wait_closed(conn, BOUND_S) == (True, b"")
        _assert_still_open(kept)
        kept.sendall(b"st: router\r\n\r\n")
        assert _read_response(kept)[0] == 200
    eventually(lambda: _closes(strict, "head_timeout"), lambda n: n >= before + 1,
               timeout_s=BOUND_S)


def test_a_slow_body_gets_408_and_reaches_no_worker(
        routers: tuple[RouterProcess, RouterProcess], fakes: dict[str, FakeWorker]) -> None:
    """A completion whose body trickles in (never finished) is answered 408 in the OpenAI
    envelope, routed nowhere, and its connection closed; control: a normal request on the same
    router is served."""
    strict, _ = routers
    before, closes = calls(fakes), _closes(strict, "body_timeout")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n")
    with _connect(strict) as conn:
        conn.sendall(head + BODY[:10])
        trickle = Trickle(conn, BODY[10:-1])  # the last byte never comes
        try:
            status, headers, payload = _read_response(conn)
        finally:
            trickle.stop()
        assert status == 408, payload
        assert json.loads(payload)["error"]["code"] == "request_timeout"
        assert json.loads(payload)["error"]["type"] == "invalid_request_error"
        assert headers["x-request-id"]
        assert headers["connection"] == "close"
        assert _wait_closed(conn, BOUND_S)[0]
    assert calls(fakes) == before
    eventually(lambda: _closes(strict, "body_timeout"), lambda n: n >= closes + 1,
               timeout_s=BOUND_S)
    with httpx.Client(trust_env=False, timeout=BOUND_S) as client:
        ok = client.post(strict.url + "/v1/completions", content=BODY,
                         headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text
    assert sum(calls(fakes).values()) > sum(before.values())


def test_a_body_trickled_after_its_answer_is_cut_at_the_body_deadline(
        routers: tuple[RouterProcess, RouterProcess], fakes: dict[str, FakeWorker]) -> None:
    """A request the router answers without reading its body (413 on its declared length) keeps
    its connection while the body may still come, and loses it once the body deadline passes,
    however steadily it trickles. Negative control: without the deadline the same trickle holds
    its connection open."""
    strict, control = routers
    before, closes = calls(fakes), _closes(strict, "body_timeout")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
    with _connect(strict) as conn, _connect(control) as kept:
        for sock in (conn, kept):
            sock.sendall(head + b"{")
            assert _read_response(sock)[0] == 413
        trickles = [Trickle(conn, b" " * 200), Trickle(kept, b" " * 200)]
        try:
            assert _wait_closed(conn, BOUND_S) == (True, b"")
            _assert_still_open(kept)
        finally:
            for t in trickles:
                t.stop()
    assert calls(fakes) == before
    eventually(lambda: _closes(strict, "body_timeout"), lambda n: n >= closes + 1,
               timeout_s=BOUND_S)
    assert _closes(control, "body_timeout") == 0


def test_a_request_head_over_64_kib_gets_431_and_is_closed(
        routers: tuple[RouterProcess, RouterProcess]) -> None:
    """Neither httptools nor uvicorn bounds a head: one streamed past 64 KiB, well within the
    header deadline, is answered 431 in the OpenAI envelope and closed, and counted as too
    large (not as late); control: a 32 KiB head on the same router is served."""
    strict, _ = routers
    before = _closes(strict, "head_too_large")
    limit = 64 * 1024 * 1024  # what a client could stream in one deadline: never reached
    with _connect(strict) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\n")
        sent = 0
        try:
            while sent < limit:  # headers without an end
                conn.sendall(b"X-Pad: " + b"p" * 8185 + b"\r\n")
                sent += 8194
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router closed while the socket buffers still held what we sent
        closed, answer = _wait_closed(conn, BOUND_S)
    assert closed and sent < limit
    if answer:  # a reset may discard it on the way; when it arrives it is the 431
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert b'"code": "request_header_too_large"' in answer
    eventually(lambda: _closes(strict, "head_too_large"), lambda n: n >= before + 1,
               timeout_s=BOUND_S)
    with _connect(strict) as ok:
        pad = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(32))
        ok.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\n" + pad + b"\r\n")
        assert _read_response(ok)[0] == 200


def _kept_alive_connection(router: RouterProcess) -> socket.socket:
    """A connection that was just served (and so is open and counted by uvicorn)."""
    def attempt() -> socket.socket | None:
        sock = _connect(router)
        sock.sendall(HEALTH)
        if _read_response(sock)[0] == 200:
            return sock
        sock.close()  # a closed poll connection the router had not yet seen go
        return None

    found = eventually(attempt, lambda s: s is not None, timeout_s=BOUND_S)
    assert found is not None
    return found


def test_past_max_connections_a_request_gets_503_and_reaches_no_worker(
        redis_server: RedisServer, workers: dict[str, FakeWorker],
        fakes: dict[str, FakeWorker]) -> None:
    """--max-connections 2 (uvicorn's limit_concurrency, which counts the arriving connection
    itself): with one kept-alive connection open, a completion on a second gets 503 before the
    app and reaches no worker; control: once the first is gone, a new connection is served."""
    capped = _router(redis_server.url, max_connections=2).start()
    try:
        before = calls(fakes)
        with _kept_alive_connection(capped) as first, _connect(capped) as second:
            second.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
            status, _, payload = _read_response(second)
            assert status == 503, payload
            assert _is_open(first)
        assert calls(fakes) == before
        with _kept_alive_connection(capped) as again:
            again.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
            status, _, payload = _read_response(again)
            assert status == 200, payload
    finally:
        capped.stop()


def test_the_router_process_froze_its_start_up_heap(
        routers: tuple[RouterProcess, RouterProcess]) -> None:
    """``python -m router.main`` settles its heap (``router.heap``): its start-up objects are
    out of the collector's full passes, which would otherwise hold the loop for each of them."""
    strict, _ = routers
    assert value(scrape(strict.url), "pdserve_router_heap_frozen_objects") > 10_000


def test_the_router_process_tokenizes_without_torch(
        routers: tuple[RouterProcess, RouterProcess]) -> None:
    """The router loads its workers' tokenizer without importing torch (``router.api.
    tokenizer_class.lean_class``). Control: the tokenizer's own native library is mapped, so
    this is a process that loaded one."""
    strict, _ = routers
    assert strict.proc is not None
    maps = Path(f"/proc/{strict.proc.pid}/maps")
    assert eventually(lambda: "tokenizers.abi3" in maps.read_text(), bool, timeout_s=BOUND_S)
    assert "libtorch" not in maps.read_text()
