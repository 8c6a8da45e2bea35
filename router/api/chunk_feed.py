"""A worker's streamed body as a feed its one reader polls and waits on, with a bound.

A relayed stream waits for the worker's next chunk with a bound (its stall bound, or the probe
check before the first output) and must wake at once when the request moves
(``router.api.resume``). A reader task, a queue and an ``asyncio.timeout`` per wait did that at
two task steps, a queue hand-off and a timeout object per chunk (what that cost per relayed
token: README, "Router overhead"). A feed is waited on directly:

- the router's own transport (``router.api.transport``) is a feed already: its connection buffers
  what arrives and wakes the one waiter;
- any other answer (``httpx.MockTransport`` in tests, httpx's own transport for ``https``) is
  read by a task into a buffer (:class:`TaskFeed`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

import httpx

from router.api.transport import Body, wait_bounded


class ChunkFeed(Protocol):
    """What a stream's reader needs of a worker's body."""

    def take(self) -> bytes:
        """Everything received and not taken yet (``b""``: nothing)."""

    def ended(self) -> bool:
        """Whether the body ended after everything was taken; raises its failure (an
        ``httpx.HTTPError``) once everything received before it was taken."""

    async def wait(self, timeout_s: float | None) -> bool:
        """Until there is news (data, the end, a failure, :meth:`wake`); False when
        ``timeout_s`` passed first."""

    def wake(self) -> None:
        """End a pending :meth:`wait` now (it returns True)."""

    def stop(self) -> None:
        """Stop reading (the answer is being closed)."""


def feed_of(response: httpx.Response) -> ChunkFeed:
    """``response``'s body as a feed: the transport's own when it is one, else read by a task."""
    stream = response.stream
    if isinstance(stream, Body):
        return stream
    return TaskFeed(response.aiter_raw())


class TaskFeed:
    """:class:`ChunkFeed` over any async iterator of chunks, read by a task of its own."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._source: AsyncIterator[bytes] | None = chunks
        self._chunks: collections.deque[bytes] = collections.deque()
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[object] | None = None
        self._task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        """Read from the first use on (a feed never read starts no task)."""
        if self._source is not None:
            source, self._source = self._source, None
            self._task = asyncio.get_running_loop().create_task(self._read(source))

    async def _read(self, chunks: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in chunks:
                if chunk:
                    self._chunks.append(chunk)
                    self.wake()
        except httpx.HTTPError as exc:
            self._error = exc
        except Exception as exc:  # e.g. the connection closed under the read: a failed body
            self._error = httpx.ReadError(f"reading the worker's stream failed: {exc!r}")
        self._done = True
        self.wake()

    def take(self) -> bytes:
        self._start()
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        return data

    def ended(self) -> bool:
        if self._chunks or not self._done:
            return False
        if self._error is not None:
            raise self._error
        return True

    async def wait(self, timeout_s: float | None) -> bool:
        self._start()
        if self._chunks or self._done:
            return True
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            return await wait_bounded(waiter, timeout_s)
        finally:
            self._waiter = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stop(self) -> None:
        self._source = None
        if self._task is not None:
            self._task.cancel()
