"""Per-request context: the request id contextvar, the ASGI middleware that sets it, and the
logging filter that puts it (and the process role) in every log line.

A request has two ids: the client's (``X-Request-Id`` when it is a sane token, else a fresh
one), echoed on the response and put in log lines; and the router's own, unique per request
(:func:`upstream_request_id`), used as the key of its ledgers and sent to the workers."""

from __future__ import annotations

import logging
import re
import secrets
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
SCOPE_KEY = "pdserve.request_id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

request_id_var: ContextVar[str] = ContextVar("pdserve_request_id", default="-")


def new_request_id() -> str:
    """A fresh request id: ``pd-`` and 32 random hex digits."""
    return f"pd-{secrets.token_hex(16)}"


def accept_request_id(raw: str | None) -> str:
    """The client's id when it is a sane token, otherwise a fresh one."""
    if raw and _VALID_ID.match(raw):
        return raw
    return new_request_id()


def upstream_request_id(request_id: str) -> str:
    """The id the router keys its ledgers by and sends upstream: unique even when clients
    reuse an ``X-Request-Id`` (two requests under one id would otherwise share, and leak,
    one ledger entry). The client's id stays a prefix, so logs and timelines still find it."""
    return f"{request_id}.{secrets.token_hex(4)}"


class RequestIdMiddleware:
    """Gives every HTTP request an id (client's ``X-Request-Id`` or a new one) and echoes it
    on every response, errors and streams included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = None
        for key, value in scope.get("headers", []):
            if key == REQUEST_ID_HEADER.encode():
                raw = value.decode("latin-1")
                break
        rid = accept_request_id(raw)
        scope[SCOPE_KEY] = rid
        token = request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


class RequestContextFilter(logging.Filter):
    """Adds ``request_id`` and ``role`` attributes to every record passing a handler."""

    def __init__(self, role: str = "router") -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.role = self.role
        return True
