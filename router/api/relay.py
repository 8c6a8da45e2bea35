"""Relaying a worker's answer to the client: whole bodies, and streams whose cleanup always runs
and whose first output is detected (the router's TTFT)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.api.fastjson import loads
from router.api.upstream_errors import stable_error_body
from router.api.usage import has_content, split_events
from router.http_protocol import CLIENT_LINK, ClientLink


def relay_body(resp_content: bytes, status: int, content_type: str | None) -> Response:
    """A worker's whole (non-streamed) answer, relayed as it came; a 4xx refusal in our stable
    error envelope instead of vLLM's (``router.api.upstream_errors``)."""
    if 400 <= status < 500:
        return Response(content=stable_error_body(resp_content, status), status_code=status,
                        media_type="application/json")
    return Response(content=resp_content, status_code=status,
                    media_type=content_type or "application/json")


class FirstOutput:
    """Finds the first SSE event that carries generated output (or ends the stream)."""

    _LIMIT = 1 << 20

    def __init__(self) -> None:
        self._buf = b""
        self.found = False

    def feed(self, chunk: bytes) -> bool:
        """True once the stream so far holds the first output (or its end)."""
        if self.found:
            return True
        self._buf = (self._buf + chunk)[-self._LIMIT:]
        events, self._buf = split_events(self._buf)
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and self._has_output(line[5:].strip()):
                    self.found = True
                    return True
        return False

    def observe(self, data: dict[str, Any]) -> bool:
        """``feed`` for one event already decoded (its ``[DONE]``: :meth:`ended`)."""
        if not self.found and _is_output(data):
            self.found = True
        return self.found

    def ended(self) -> None:
        """The stream's ``[DONE]`` was relayed."""
        self.found = True

    @staticmethod
    def _has_output(payload: bytes) -> bool:
        if payload == b"[DONE]":
            return True
        try:
            data = loads(payload)
        except ValueError:
            return False
        return isinstance(data, dict) and _is_output(data)


def _is_output(data: dict[str, Any]) -> bool:
    """An event with generated output, an error, or a finish."""
    if "error" in data or has_content(data):
        return True
    return any(isinstance(c, dict) and c.get("finish_reason") for c in data.get("choices") or [])


class RelayResponse(StreamingResponse):
    """A streaming response whose cleanup runs even when the body is never iterated
    (client gone before the first byte).

    Under ASGI before 2.4 (uvicorn's) the body is sent from the request's own task, which is
    cancelled when the client disconnects (the stream then ends quietly: its upstream call is
    closed, so the worker aborts the request). The router's own connection protocol says so
    itself (``router.http_protocol.ClientLink``); under any other server a plain asyncio task
    waits for the ``http.disconnect``.
    Starlette does the same with an anyio task group, which cost the router about a twentieth
    of its CPU per request. From 2.4 a gone client fails the send, as in Starlette."""

    def __init__(self, content: AsyncIterator[bytes], *, status_code: int, media_type: str,
                 cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, status_code=status_code, media_type=media_type)
        self._cleanup = cleanup
        self._sending = False
        self._client_left = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            spec = scope.get("asgi", {}).get("spec_version", "2.0")
            if tuple(map(int, spec.split("."))) >= (2, 4):  # a gone client fails the send
                try:
                    await self.stream_response(send)
                except OSError:
                    raise ClientDisconnect() from None
            elif isinstance(link := scope.get(CLIENT_LINK), ClientLink):
                await self._send_linked(link, send)
            else:
                await self._send_watched(receive, send)
            if self.background is not None:
                await self.background()
        finally:
            await self._cleanup()

    async def _send_linked(self, link: ClientLink, send: Send) -> None:
        """:meth:`_send_watched` told by the router's own connection protocol that the client
        left (``router.http_protocol.ClientLink``): no watcher task per stream."""
        if link.gone:  # it left while the handler waited (on its prefill): no decode call
            return
        task = asyncio.current_task()
        assert task is not None
        handle = link.on_gone(lambda: self._client_gone(task))
        try:
            await self._send_until_gone(task, send)
        finally:
            link.forget(handle)

    async def _send_watched(self, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(self._watch(receive, task))
        try:
            # the watcher's first look comes before the body's first upstream call: a client
            # that left while the handler waited (on its prefill) gets no decode call
            await self._send_until_gone(task, send, first_look=True)
        finally:
            watcher.cancel()  # after the sending ended: it cancels nothing now

    async def _send_until_gone(self, task: asyncio.Task[Any], send: Send, *,
                               first_look: bool = False) -> None:
        """Send the body from ``task``; a cancel of it by :meth:`_client_gone` ends the stream
        quietly (``first_look``: yield once first, for a watcher to see a disconnect)."""
        self._sending = True
        try:
            if first_look:
                await asyncio.sleep(0)
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not self._client_left:
                raise
            task.uncancel()  # our own cancel: the client left, the stream just ends
        finally:
            self._sending = False  # before any other await: a late disconnect cancels nothing

    def _client_gone(self, sender: asyncio.Task[Any]) -> None:
        """The client disconnected: a body being sent stops (its sending task is cancelled)."""
        if self._sending:
            self._client_left = True
            sender.cancel()

    async def _watch(self, receive: Receive, sender: asyncio.Task[Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone(sender)
