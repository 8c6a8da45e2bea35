"""The router's HTTP/1.1 connection protocol: uvicorn's httptools protocol with deadlines on
slow clients and a cap on request heads (security review finding 12).

uvicorn arms its only connection timer, ``timeout_keep_alive``, after a response, and cancels
it whenever bytes arrive: a client that opens a connection and sends its request head a byte at
a time (slowloris), or nothing at all, or trickles a body the router has already answered,
holds a file descriptor and a protocol object for as long as it likes, and enough of them
exhaust the router's descriptors. This subclass closes such connections. Parameters (the
router's settings, ``router.settings``):

- ``header_timeout_s`` (``--header-timeout-s``, default 10 s; 0 = off): the request head
  (request line and headers) must be complete this long after the connection was accepted or,
  on a kept-alive connection, after the first byte of its next request (between requests
  uvicorn's keep-alive timeout applies). Past it the connection is closed without an answer.
- ``body_timeout_s`` (``--body-timeout-s``, default 30 s; 0 = off): the request body must be
  complete this long after the head. The app answers a late body it is reading with 408
  (``router.api.untrusted.read_capped_body``); here, a connection whose response is complete
  while its body is still late is closed, whether the app read the body or answered without it
  (413 on a declared length, 401, a route that takes no body). Before the deadline it stays
  open, so a client finishing an upload the router refused keeps its connection.
- ``max_head_bytes`` (default 64 KiB, :data:`MAX_HEAD_BYTES`): neither httptools nor uvicorn
  bounds a request head, so within the header deadline a client could stream headers into the
  router's memory at line rate. A head past this size is answered 431 (the OpenAI error
  envelope) and the connection closed.

Each close is reported to ``on_close`` with its reason: ``head_timeout``, ``body_timeout`` or
``head_too_large`` (``pdserve_router_connections_closed_total``). A client that pipelines a
partial head behind a running request loses both when the head is late.

httptools is the parser uvicorn picks when it is installed (``http="auto"``); the router names
this class explicitly, so httptools is a declared dependency.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

Reason = Literal["head_timeout", "body_timeout", "head_too_large"]

MAX_HEAD_BYTES = 64 * 1024
"""Largest request head taken (request line and headers): four times the 16 KiB that h11,
uvicorn's other parser, allows; an OpenAI client sends well under 2 KiB."""


CLIENT_LINK = "pdserve.client"
"""Scope key of the request's :class:`ClientLink` (set by :class:`SlowClientProtocol`)."""


def _ignore(_: Reason) -> None:
    return None


class ClientLink:
    """One client connection's end, told to whoever registered for it: a streaming response
    learns that its client left without a task of its own waiting on ASGI ``receive`` for the
    ``http.disconnect`` (``router.api.relay``)."""

    def __init__(self) -> None:
        self.gone = False
        """The connection closed."""
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0

    def on_gone(self, callback: Callable[[], None]) -> int:
        """Call ``callback`` when the connection closes; a handle for :meth:`forget`."""
        self._next += 1
        self._callbacks[self._next] = callback
        return self._next

    def forget(self, handle: int) -> None:
        """The callback of ``handle`` is no longer wanted."""
        self._callbacks.pop(handle, None)

    def lost(self) -> None:
        """The connection closed: every registered callback runs, once."""
        self.gone = True
        callbacks, self._callbacks = self._callbacks, {}
        for callback in callbacks.values():
            callback()


def _head_too_large(limit: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request head is larger than {limit} bytes", "type":
        "invalid_request_error", "param": None, "code": "request_header_too_large"}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@dataclass(frozen=True)
class SlowClientLimits:
    """What a connection of the router is allowed (see the module docstring)."""

    header_timeout_s: float = 0.0
    """Longest a request head may take to arrive; 0 = no deadline."""
    body_timeout_s: float = 0.0
    """Longest a request body may take to arrive after its head; 0 = no deadline."""
    max_head_bytes: int = MAX_HEAD_BYTES
    """Largest request head (431 above; counted to the read that passes it)."""
    on_close: Callable[[Reason], None] = field(default=_ignore)
    """Called once per connection closed for one of these limits (the metric)."""


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that closes connections whose request head or body is
    late, or whose head is too large (see the module docstring)."""

    limits: ClassVar[SlowClientLimits] = SlowClientLimits()
    """Set on a subclass by :func:`protocol_class` (uvicorn builds protocols itself)."""

    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_due: float | None = None
    """Loop time the current request's body is due by (None: none pending, or no deadline)."""
    _in_head = False
    """A request head is being received (from the accept, or a next request's first byte)."""
    _head_bytes = 0
    """Bytes received while the current head was pending."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._link = ClientLink()
        super().connection_made(transport)
        self._in_head = True
        self._arm_head()  # from the accept: a client that sends nothing is late too

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_head_bytes \
                and not self.transport.is_closing():
            self._cancel_head()
            self.limits.on_close("head_too_large")
            self.transport.write(_head_too_large(self.limits.max_head_bytes))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        self._cancel_body()
        super().connection_lost(exc)
        self._link.lost()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CLIENT_LINK] = self._link  # type: ignore[literal-required]
        if not self._in_head:  # a kept-alive connection's next request: from its first byte
            self._in_head, self._head_bytes = True, 0
        self._arm_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head()
        if self.limits.body_timeout_s > 0:
            self._body_due = self.loop.time() + self.limits.body_timeout_s
            self._body_timer = self.loop.call_at(self._body_due, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_body()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._body_due is not None and self.loop.time() >= self._body_due:
            self._close("body_timeout")  # answered (408, or unread) and the body is late
        super().on_response_complete()

    def _arm_head(self) -> None:
        timeout_s = self.limits.header_timeout_s
        if timeout_s > 0 and self._head_timer is None:
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body_due = None

    def _head_late(self) -> None:
        self._head_timer = None
        self._close("head_timeout")

    def _body_late(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        # still being answered: the app's own deadline answers 408, and on_response_complete
        # closes then; a pipelined request's cycle is never current while a body arrives
        if cycle is not None and cycle.response_complete:
            self._close("body_timeout")

    def _close(self, reason: Reason) -> None:
        """Count and close (a response being written, the 408, is flushed first)."""
        self._cancel_body()
        if self.transport.is_closing():
            if reason == "body_timeout":  # the app's 408 said `connection: close` itself
                self.limits.on_close(reason)
            return
        logger.debug("closing the connection of %s: %s", self.client, reason)
        self.limits.on_close(reason)
        self.transport.close()


def protocol_class(limits: SlowClientLimits) -> type[SlowClientProtocol]:
    """A :class:`SlowClientProtocol` bound to ``limits``, for ``uvicorn.Config(http=...)``."""

    class Bound(SlowClientProtocol):
        pass

    Bound.limits = limits
    return Bound
