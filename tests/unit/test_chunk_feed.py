"""A worker's streamed body as a feed (``router.api.chunk_feed``): the router's own transport's
body against a real loopback server, and the task-read feed any other answer gets; and
``UpstreamTransport.post``, the request written without an ``httpx.Request``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from router.api.chunk_feed import ChunkFeed, TaskFeed, feed_of
from router.api.transport import Body, UpstreamTransport
from tests.unit.test_upstream_transport import Server, read_request

URL_PATH = "/v1/completions"


def paced(*parts: bytes, gap_s: float = 0.0, end: bool = True):  # type: ignore[no-untyped-def]
    """A handler answering one chunked stream: ``parts`` with ``gap_s`` between them, then its
    end (or nothing more, the connection held open: a stalled worker)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for part in parts:
            await asyncio.sleep(gap_s)
            writer.write(b"%x\r\n%b\r\n" % (len(part), part))
            await writer.drain()
        if end:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        else:
            await asyncio.sleep(30)
    return handler


async def drain(feed: ChunkFeed, bound_s: float = 5.0) -> list[bytes]:
    """Everything the feed gives until its end, one ``take`` per wake."""
    got = []
    while True:
        data = feed.take()
        if data:
            got.append(data)
            continue
        if feed.ended():
            return got
        assert await feed.wait(bound_s), "the feed went silent"


async def open_feed(url: str, transport: UpstreamTransport,
                    read_s: float | None = 5.0) -> tuple[httpx.Response, ChunkFeed]:
    resp = await transport.post(httpx.URL(url + URL_PATH), b"{}",
                                {"content-type": "application/json"},
                                {"connect": 2.0, "read": read_s, "pool": 2.0})
    return resp, feed_of(resp)


async def test_the_transport_body_is_its_own_feed_and_gives_every_byte() -> None:
    parts = [b"data: %d\n\n" % i for i in range(5)]
    transport = UpstreamTransport()
    async with Server(paced(*parts, gap_s=0.01)) as url:
        resp, feed = await open_feed(url, transport)
        assert isinstance(feed, Body) and feed is resp.stream  # no task, no copy between
        got = await drain(feed)
        await resp.aclose()
    assert b"".join(got) == b"".join(parts)
    assert len(got) > 1  # it was handed over as it arrived, not at the end
    await transport.aclose()


async def test_a_bounded_wait_times_out_and_the_next_one_still_gets_the_data() -> None:
    transport = UpstreamTransport()
    async with Server(paced(b"late", gap_s=0.3)) as url:
        resp, feed = await open_feed(url, transport)
        assert feed.take() == b""
        assert await feed.wait(0.05) is False  # the bound passed first
        assert await feed.wait(0.05) is False  # and again: the reused timer re-arms
        assert await feed.wait(5.0) is True
        assert feed.take() == b"late"
        await resp.aclose()
    await transport.aclose()


async def test_wake_ends_a_wait_at_once() -> None:
    transport = UpstreamTransport()
    async with Server(paced(b"x", end=False, gap_s=10)) as url:
        resp, feed = await open_feed(url, transport)
        asyncio.get_running_loop().call_later(0.05, feed.wake)
        assert await feed.wait(5.0) is True  # the waker's news (a passed bound gives False)
        assert feed.take() == b"" and not feed.ended()  # control: nothing came
        await resp.aclose()
    await transport.aclose()


async def test_the_read_timeout_still_bounds_a_silent_body() -> None:
    """No bound of its own (``wait(None)``): the transport's read timeout ends the wait."""
    transport = UpstreamTransport()
    async with Server(paced(b"first", end=False)) as url:
        resp, feed = await open_feed(url, transport, read_s=0.2)
        assert await drain_until(feed, b"first")
        with pytest.raises(httpx.ReadTimeout):
            await feed.wait(None)
        await resp.aclose()
    await transport.aclose()


async def read_to_failure(feed: ChunkFeed, got: bytearray) -> None:
    """Read into ``got`` until the feed raises its failure (it must fail, not end)."""
    while True:
        got += feed.take()
        assert not feed.ended(), "the body ended without its failure"
        await feed.wait(5.0)


async def drain_until(feed: ChunkFeed, want: bytes) -> bool:
    got = b""
    while want not in got:
        got += feed.take()
        if want not in got:
            await feed.wait(5.0)
    return True


async def test_a_failure_is_raised_after_what_came_before_it() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.close()  # cut short: no terminating chunk

    transport = UpstreamTransport()
    async with Server(cut) as url:
        resp, feed = await open_feed(url, transport)
        got = bytearray()
        with pytest.raises(httpx.RemoteProtocolError):
            await read_to_failure(feed, got)
        assert got == b"hello"
        await resp.aclose()
    await transport.aclose()


async def test_post_writes_host_headers_and_length_and_reuses_the_connection() -> None:
    seen: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            seen.append(request)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    transport = UpstreamTransport()
    server = Server(echo)
    async with server as url:
        for body in (b'{"a": 1}', b"{}"):
            resp = await transport.post(httpx.URL(url + URL_PATH + "?q=1"), body,
                                        {"x-request-id": "r1", "content-length": "999"},
                                        {"connect": 2.0, "read": 2.0, "pool": 2.0})
            assert resp.status_code == 200 and await resp.aread() == b"ok"
            await resp.aclose()
    head, _, sent = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions?q=1 HTTP/1.1"
    assert b"host: " + url.removeprefix("http://").encode() in lines
    assert b"x-request-id: r1" in lines
    assert [x for x in lines if x.startswith(b"content-length")] == [b"content-length: 8"]
    assert sent == b'{"a": 1}'
    assert server.connections == 1  # kept alive for the second
    await transport.aclose()


# ---- the task-read feed (any other answer) ---------------------------------------------------

async def chunks_of(*parts: bytes | BaseException, gap_s: float = 0.0) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(gap_s)
        if isinstance(part, BaseException):
            raise part
        yield part


async def test_a_task_feed_gives_everything_then_its_end() -> None:
    feed = TaskFeed(chunks_of(b"a", b"b", b"c", gap_s=0.01))
    assert b"".join(await drain(feed)) == b"abc"


async def test_a_task_feed_raises_its_failure_after_the_data() -> None:
    feed = TaskFeed(chunks_of(b"a", httpx.ReadError("reset")))
    got = bytearray()
    with pytest.raises(httpx.ReadError):
        await read_to_failure(feed, got)
    assert got == b"a"


async def test_a_task_feed_reads_nothing_until_used_and_stop_ends_its_task() -> None:
    started = asyncio.Event()

    async def source() -> AsyncIterator[bytes]:
        started.set()
        yield b"x"
        await asyncio.sleep(30)
        yield b"never"

    feed = TaskFeed(source())
    await asyncio.sleep(0.01)
    assert not started.is_set()  # control: a feed never read starts no task
    assert await feed.wait(5.0) and feed.take() == b"x"
    assert await feed.wait(0.05) is False  # silent: the bound passes
    feed.stop()
    await asyncio.sleep(0.01)
    assert feed._task is not None and feed._task.cancelled()


async def test_feed_of_an_answer_of_another_transport_is_task_read() -> None:
    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b"who"
            yield b"le"

    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Stream()))
    async with httpx.AsyncClient(transport=transport) as client, \
            client.stream("POST", "http://worker/v1/completions") as resp:
        feed = feed_of(resp)
        assert isinstance(feed, TaskFeed)
        assert b"".join(await drain(feed)) == b"whole"
