"""RelayResponse under ASGI: the body is sent, a client that leaves stops it quietly, and its
cleanup runs whatever happens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.api.relay import RelayResponse
from router.http_protocol import CLIENT_LINK, ClientLink


class Relay:
    """A RelayResponse over a body that sends ``first`` and then waits on ``more``."""

    def __init__(self) -> None:
        self.more: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.body_closed = False
        self.cleaned = 0
        self.disconnect = asyncio.Event()

    async def body(self) -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            while (chunk := await self.more.get()) is not None:
                yield chunk
        finally:
            self.body_closed = True

    async def cleanup(self) -> None:
        self.cleaned += 1

    async def receive(self) -> dict[str, Any]:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def response(self) -> RelayResponse:
        return RelayResponse(self.body(), status_code=200, media_type="text/event-stream",
                             cleanup=self.cleanup)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def test_a_finished_stream_is_sent_whole_and_cleaned_up_once() -> None:
    relay = Relay()
    call = asyncio.create_task(relay.response()({"type": "http"}, relay.receive, relay.send))
    relay.more.put_nowait(b"data: 2\n\n")
    relay.more.put_nowait(None)
    await asyncio.wait_for(call, 5)
    assert relay.sent[0]["type"] == "http.response.start" and relay.sent[0]["status"] == 200
    assert relay.bodies() == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert relay.cleaned == 1 and relay.body_closed
    relay.disconnect.set()  # the watcher is gone: a late disconnect cancels nothing
    await asyncio.sleep(0.01)
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_a_client_that_leaves_stops_the_stream_quietly() -> None:
    relay = Relay()
    call = asyncio.create_task(relay.response()({"type": "http"}, relay.receive, relay.send))
    await asyncio.sleep(0.01)  # the first chunk is out; the body waits for more
    assert relay.bodies() == [b"data: 1\n\n"]
    relay.disconnect.set()
    await asyncio.wait_for(call, 5)  # returns: no CancelledError escapes
    assert relay.body_closed and relay.cleaned == 1
    assert not call.cancelled() and call.cancelling() == 0


async def test_a_cancel_from_outside_still_propagates_and_cleans_up() -> None:
    relay = Relay()
    call = asyncio.create_task(relay.response()({"type": "http"}, relay.receive, relay.send))
    await asyncio.sleep(0.01)
    call.cancel()  # the server stopping, or the answer deadline
    with pytest.raises(asyncio.CancelledError):
        await call
    assert relay.body_closed and relay.cleaned == 1


# ---- told by the router's own connection protocol (router.http_protocol.ClientLink) ---------

def linked_scope() -> tuple[dict[str, Any], ClientLink]:
    link = ClientLink()
    return {"type": "http", CLIENT_LINK: link}, link


async def test_a_linked_client_that_leaves_stops_the_stream_quietly() -> None:
    relay, (scope, link) = Relay(), linked_scope()
    call = asyncio.create_task(relay.response()(scope, relay.receive, relay.send))
    await asyncio.sleep(0.01)
    assert relay.bodies() == [b"data: 1\n\n"]
    link.lost()  # the connection closed; nobody waits on receive()
    await asyncio.wait_for(call, 5)
    assert relay.body_closed and relay.cleaned == 1
    assert not call.cancelled() and call.cancelling() == 0
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_a_linked_stream_that_ends_leaves_nothing_registered() -> None:
    """Control: a late close of the connection (after the answer) cancels nothing."""
    relay, (scope, link) = Relay(), linked_scope()
    call = asyncio.create_task(relay.response()(scope, relay.receive, relay.send))
    relay.more.put_nowait(None)
    await asyncio.wait_for(call, 5)
    assert relay.bodies() == [b"data: 1\n\n", b""] and relay.cleaned == 1
    link.lost()
    assert not call.cancelled()


async def test_a_client_gone_before_the_stream_starts_gets_nothing_sent() -> None:
    """It left while the handler waited (its prefill): the body is never asked for."""
    relay, (scope, link) = Relay(), linked_scope()
    link.lost()
    await relay.response()(scope, relay.receive, relay.send)
    assert relay.sent == [] and relay.cleaned == 1


async def test_a_cancel_from_outside_still_propagates_with_a_link() -> None:
    relay, (scope, _) = Relay(), linked_scope()
    call = asyncio.create_task(relay.response()(scope, relay.receive, relay.send))
    await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert relay.body_closed and relay.cleaned == 1
