"""API keys on the router (``--api-key``, as ``vllm serve --api-key``): OpenAI-style 401.

Every path needs ``Authorization: Bearer <key>`` except the probes (``/health``, ``/metrics``),
which orchestrators and Prometheus scrape without credentials. ``/workers`` (internal URLs and
loads, and with ``?prompt=`` the router's cache model's view of any prompt: an oracle on other
tenants' prompts) needs an admin key (``--admin-api-key``): 403 for any other. Keys are compared
in constant time, each one, so the answer time says nothing about which key or how much of it
matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({"/workers"})


def _error(message: str, code: str, status: int = 401) -> bytes:
    """The envelope, serialised as every other error of the router (starlette's compact JSON)."""
    return bytes(JSONResponse(APIError(message, status=status, code=code).to_dict()).body)


def presented_key(authorization: str | None) -> str | None:
    """The key a ``Bearer <key>`` header presents, spelled as :class:`ApiKeys` compares it
    (scheme in any case, spaces around the key ignored); None without a bearer key."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    key = token.strip()
    return key if key and scheme.lower() == "bearer" else None


def key_id(authorization: str | None) -> str:
    """A stable, non-reversible id of the key a request presents ("" for none): what per-key
    limits count by (however the header spells the scheme or spaces it), never the key."""
    key = presented_key(authorization)
    return "" if key is None else hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeys:
    """The accepted keys; ``allows`` checks one ``Authorization`` header value."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys if k)
        if not self._keys:
            raise ValueError("ApiKeys needs at least one non-empty key")

    def allows(self, authorization: str | None) -> bool:
        """True for ``Bearer <one of the keys>``."""
        key = presented_key(authorization)
        if key is None:
            return False
        presented = key.encode()
        ok = False
        for accepted in self._keys:  # no early exit: every key costs the same
            ok |= hmac.compare_digest(accepted, presented)
        return ok


class ApiKeyMiddleware:
    """Answers 401 in OpenAI's error envelope unless the request carries a valid key."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, admin: ApiKeys | None = None) -> None:
        self.app = app
        self.keys = keys
        self.admin = admin
        """Keys that pass everywhere, ``ADMIN_PATHS`` included (None: nobody reads those)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                header = value.decode("latin-1")
                break
        is_admin = self.admin is not None and self.admin.allows(header)
        if scope.get("path") in ADMIN_PATHS:
            allowed = is_admin
        else:
            allowed = is_admin or self.keys.allows(header)
        if allowed:
            await self.app(scope, receive, send)
            return
        status = 401
        if header is None:
            body = _error("You didn't provide an API key. Provide it in the Authorization "
                          "header as 'Bearer <key>'.", "missing_api_key")
        elif self.keys.allows(header):
            status = 403
            body = _error("this path needs an admin key (--admin-api-key)",
                          "admin_key_required", status)
        else:
            body = _error("Incorrect API key provided.", "invalid_api_key")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b'Bearer realm="pdserve"'),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
