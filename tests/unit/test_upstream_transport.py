"""The router's upstream transport (``router.api.transport``) against a real loopback server:
bodies as they arrive, keep-alive and its limits, and every failure as the httpx exception
httpcore raises for it (the proxy's retry rules read those)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from router.api import transport as transport_module
from router.api.transport import UpstreamTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A loopback server whose every connection runs ``handler``; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()
            self.closed.set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (``content-length`` framed); b"" at EOF."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


def answer(body: bytes, *, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-length: %d\r\n" % len(body) + extra +
            b"\r\n" + body)


def chunked(*parts: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" +
            b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n")


def keep_answering(response: bytes) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(response)
            await writer.drain()
    return handler


async def stream(client: httpx.AsyncClient, url: str) -> list[bytes]:
    async with client.stream("POST", url + "/v1/completions", content=b"{}") as resp:
        assert resp.status_code == 200
        return [part async for part in resp.aiter_raw()]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=UpstreamTransport(), trust_env=False) as c:
        yield c


async def test_whole_and_chunked_bodies_reuse_one_connection(client: httpx.AsyncClient
                                                             ) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            seen.append(request)
            writer.write(answer(b'{"ok":true}', extra=b"content-type: application/json\r\n")
                         if request.startswith(b"GET") else chunked(b"data: 1\n\n", b"data: 2\n\n"))
            await writer.drain()

    server = Server(handler)
    async with server as url:
        resp = await client.get(url + "/metrics?x=1")
        assert resp.status_code == 200 and resp.json() == {"ok": True}
        assert b"".join(await stream(client, url)) == b"data: 1\n\ndata: 2\n\n"
        resp = await client.post(url + "/v1/completions", content=b'{"a":1}',
                                 headers={"x-request-id": "r1"})
        assert resp.content == b"data: 1\n\ndata: 2\n\n"
    assert server.connections == 1
    assert seen[0].startswith(b"GET /metrics?x=1 HTTP/1.1\r\n")
    assert b"content-length" not in seen[0].lower()
    assert seen[2].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"x-request-id: r1\r\n" in seen[2] and b"content-length: 7\r\n" in seen[2]
    assert seen[2].endswith(b'\r\n\r\n{"a":1}')


async def test_a_body_is_handed_over_as_it_arrives(client: httpx.AsyncClient) -> None:
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await go.wait()
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")

    async with Server(handler) as url, client.stream("POST", url, content=b"{}") as resp:
        parts = resp.aiter_raw()
        assert await parts.__anext__() == b"first"  # before the rest was even sent
        go.set()
        assert [p async for p in parts] == [b"last"]


async def test_a_stream_left_early_closes_its_connection(client: httpx.AsyncClient) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await reader.read()  # until the router hangs up (vLLM then aborts the request)

    server = Server(handler)
    async with server as url:
        async with client.stream("POST", url, content=b"{}") as resp:
            async for _ in resp.aiter_raw():
                break
        await asyncio.wait_for(server.closed.wait(), 5)


async def test_nobody_listening_is_a_connect_error(client: httpx.AsyncClient) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(httpx.ConnectError):
        await client.get(f"http://127.0.0.1:{port}/health")


@pytest.mark.parametrize(("sent", "error"), [
    (b"", httpx.RemoteProtocolError),  # closed with no answer: a stale kept-alive connection
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n",
     httpx.RemoteProtocolError),
    (b"SSH-2.0-OpenSSH\r\n\r\n", httpx.RemoteProtocolError),
], ids=["no-answer", "short-body", "unfinished-chunks", "not-http"])
async def test_answers_cut_short_raise_what_httpcore_raises(
        client: httpx.AsyncClient, sent: bytes, error: type[Exception]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sent)
        await writer.drain()

    async with Server(handler) as url:
        with pytest.raises(error):
            await client.post(url, content=b"{}")


async def test_an_answer_read_to_the_close_without_framing_is_complete(
        client: httpx.AsyncClient) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")

    async with Server(handler) as url:
        assert (await client.post(url, content=b"{}")).content == b"all of it"


async def test_read_timeouts_bound_the_head_and_every_wait_in_the_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        if not request.startswith(b"POST /silent "):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await asyncio.sleep(10)

    async with Server(handler) as url, httpx.AsyncClient(transport=UpstreamTransport()) as c:
        async with c.stream("POST", url, content=b"{}", timeout=0.2) as resp:
            with pytest.raises(httpx.ReadTimeout):
                async for _ in resp.aiter_raw():
                    pass
        with pytest.raises(httpx.ReadTimeout):
            await c.post(url + "/silent", content=b"{}", timeout=0.2)


async def test_pool_limit_waits_then_times_out() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            await release.wait()
            writer.write(answer(b"ok"))
            await writer.drain()

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    server = Server(handler)
    async with server as url, httpx.AsyncClient(transport=UpstreamTransport(limits)) as c:
        first = asyncio.create_task(c.post(url, content=b"{}"))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await c.post(url, content=b"{}", timeout=httpx.Timeout(5, pool=0.1))
        second = asyncio.create_task(c.post(url, content=b"{}"))
        await asyncio.sleep(0.05)
        release.set()
        assert (await first).content == (await second).content == b"ok"
    assert server.connections == 1


async def test_an_idle_connection_the_worker_closed_is_not_reused(
        client: httpx.AsyncClient) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"ok"))
        await writer.drain()  # then close, as uvicorn does past its keep-alive

    server = Server(handler)
    async with server as url:
        assert (await client.post(url, content=b"{}")).content == b"ok"
        await asyncio.wait_for(server.closed.wait(), 5)
        await asyncio.sleep(0.05)  # the close reaches the router's side
        assert (await client.post(url, content=b"{}")).content == b"ok"
    assert server.connections == 2


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing(
        monkeypatch: pytest.MonkeyPatch, client: httpx.AsyncClient) -> None:
    monkeypatch.setattr(transport_module, "HIGH_WATER", 1000)
    parts = [bytes([65 + i % 26]) * 500 for i in range(200)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(chunked(*parts))
        await writer.drain()

    async with Server(handler) as url:
        got = []
        async with client.stream("POST", url, content=b"{}") as resp:
            async for part in resp.aiter_raw():
                got.append(part)
                await asyncio.sleep(0.001)
        assert b"".join(got) == b"".join(parts)
