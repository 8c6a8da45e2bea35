"""Per-key request limits on the router's API: concurrency and a total answer deadline.

- ``--max-concurrent-per-key N``: a client (an API key; every client shares one budget when the
  router has no keys) may have at most N requests in flight on ``/v1/``; one more is answered
  429 ``concurrency_limit_exceeded`` with ``Retry-After: 1`` before anything is routed. A
  request counts until its answer's last byte is sent (a stream, until it ends).
- ``--answer-deadline-s S``: no answer lasts longer than S. Past it the router stops the
  request (the upstream call is cancelled, so the worker aborts it and frees its KV): 504
  ``answer_deadline_exceeded`` if nothing was sent yet, else a stream ends with a chunk
  closing its open choices (``finish_reason`` ``abort``), one ``data: {"error": ...}`` event
  and ``data: [DONE]`` (``router.api.stream_end``). A client that stops reading can no longer
  pin a worker's slot and a router connection forever (security review finding 13).

Runs inside the API-key check, so only authenticated requests are counted, and a key is
identified by a hash of the presented key (``auth.key_id``: the key itself is not kept, and
``bearer k`` or ``Bearer  k`` count as ``Bearer k``). Without API keys every client is one
client: a header the router does not check cannot buy a budget of its own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api.auth import key_id
from router.api.stream_end import failed_ending
from router.api.usage import StreamWatch
from router.errors import APIError

LIMITED_PREFIX = "/v1/"


def _json_response(error: APIError) -> tuple[Message, Message]:
    body = json.dumps(error.to_dict(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    return ({"type": "http.response.start", "status": error.status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False})


def client_of(scope: Scope) -> str:
    """A stable, non-reversible id of the API key a request presents ("" for none)."""
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            return key_id(value.decode("latin-1"))
    return ""


class KeyLimits:
    """In-flight counts per client; pure bookkeeping, no I/O."""

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self._in_flight: dict[str, int] = {}

    def try_enter(self, client: str) -> bool:
        """Count one more request of ``client``; False (nothing counted) past the limit."""
        held = self._in_flight.get(client, 0)
        if self.max_concurrent > 0 and held >= self.max_concurrent:
            return False
        self._in_flight[client] = held + 1
        return True

    def leave(self, client: str) -> None:
        """One request of ``client`` ended."""
        held = self._in_flight.get(client, 0) - 1
        if held > 0:
            self._in_flight[client] = held
        else:
            self._in_flight.pop(client, None)

    def in_flight(self, client: str) -> int:
        """Requests of ``client`` in flight now."""
        return self._in_flight.get(client, 0)


class LimitsMiddleware:
    """Applies `KeyLimits` and the answer deadline to every ``/v1/`` request."""

    def __init__(self, app: ASGIApp, max_concurrent: int = 0, deadline_s: float = 0.0,
                 on_refused: Any = None, keyed: bool = True) -> None:
        self.app = app
        self.keyed = keyed
        """Whether the router checks API keys (False: every client counts as one)."""
        self.limits = KeyLimits(max_concurrent)
        self.deadline_s = deadline_s
        self.on_refused = on_refused
        """Called with a reason ("concurrency" or "deadline") for each refusal (metrics)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(LIMITED_PREFIX):
            await self.app(scope, receive, send)
            return
        client = client_of(scope) if self.keyed else ""
        if not self.limits.try_enter(client):
            self._count("concurrency")
            for message in _json_response(APIError(
                    f"too many requests in flight for this API key (limit "
                    f"{self.limits.max_concurrent}); retry when one has finished",
                    status=429, code="concurrency_limit_exceeded", type="rate_limit_error",
                    headers={"Retry-After": "1"})):
                await send(message)
            return
        try:
            if self.deadline_s > 0:
                await self._with_deadline(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.limits.leave(client)

    async def _with_deadline(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = {"started": False, "ended": False, "stream": False}
        watch = StreamWatch()  # what the stream sent: the choices its ending must close
        tail = [b""]

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                for key, value in message.get("headers", []):
                    if key.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                        state["stream"] = True
            elif message["type"] == "http.response.body":
                if state["stream"] and message.get("body"):
                    watch.feed(message["body"], 0.0)
                    tail[0] = (tail[0] + message["body"])[-2:]
                if not message.get("more_body"):
                    state["ended"] = True
            await send(message)

        timeout = asyncio.timeout(self.deadline_s)
        try:
            async with timeout:
                await self.app(scope, receive, tracked)
        except TimeoutError:
            if not timeout.expired():
                raise
            self._count("deadline")
            error = APIError(f"the answer passed the router's {self.deadline_s:g} s deadline",
                             status=504, code="answer_deadline_exceeded", type="server_error")
            if not state["started"]:
                for message in _json_response(error):
                    await send(message)
            elif not state["ended"]:
                end = b""
                if state["stream"]:
                    chat = str(scope.get("path", "")).endswith("/chat/completions")
                    end = failed_ending(watch, error.to_dict(), chat=chat,
                                        model=str(watch.head.get("model", "")))
                    if tail[0] not in (b"", b"\n\n"):  # cut inside an event: end it first
                        end = b"\n\n" + end
                await send({"type": "http.response.body", "body": end, "more_body": False})

    def _count(self, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)
