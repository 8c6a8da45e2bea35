"""A worker's 4xx answer, mapped into the router's stable OpenAI error envelope.

The router validates what it can before any worker is touched (``router.api.schemas``); what a
worker still refuses arrives in vLLM's own shapes, which differ from ours:

- ``{"error": {"message", "type": "BadRequestError", "param": "temperature", "code": 400}}``
  (vLLM's ``ErrorResponse``: an integer code, a Python exception name as type),
- the same with ``"param": "body.temperature"`` and a pydantic error list as message (vLLM's
  request validation handler),
- ``{"object": "error", "message", "type", "param", "code"}`` (older vLLM) or
  ``{"detail": ...}`` (a plain FastAPI error), or a body that is not JSON at all.

Each becomes ``{"error": {"message", "type", "param", "code"}}`` with ``type``
``invalid_request_error`` (``rate_limit_error`` for 429), a snake_case string ``code`` and a
``param`` without the ``body.`` prefix; the worker's status is kept.
"""

from __future__ import annotations

import json
import re
from typing import Any

from router.errors import APIError

_STATUS_CODES = {400: "invalid_value", 401: "invalid_api_key", 403: "forbidden",
                 404: "not_found", 405: "method_not_allowed", 409: "conflict",
                 413: "request_too_large", 422: "invalid_value", 429: "rate_limit_exceeded"}
_SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")
# One entry of pydantic's error list as vLLM prints it: {'type': 'float_parsing', ..., 'msg': ...}
_PYDANTIC_ENTRY = re.compile(r"'type': '(?P<type>[a-z_]+)'.*?'msg': (?P<q>['\"])(?P<msg>.*?)(?P=q)",
                             re.DOTALL)
_TYPE_ERRORS = ("_parsing", "_type")


def _fields(content: bytes) -> dict[str, Any]:
    """The error object of the body, whatever shape it came in (empty when none)."""
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        text = content.decode(errors="replace").strip()
        return {"message": text[:500]} if text else {}
    if not isinstance(data, dict):
        return {}
    if isinstance(data.get("error"), dict):
        return dict(data["error"])
    if isinstance(data.get("error"), str):
        return {"message": data["error"]}
    if "message" in data:
        return data
    if "detail" in data:
        detail = data["detail"]
        return {"message": detail if isinstance(detail, str) else json.dumps(detail)}
    return {}


def _param(raw: object) -> str | None:
    if not isinstance(raw, str) or not raw:
        return None
    param = raw.removeprefix("body.").removeprefix("body")
    return param or None


def upstream_api_error(content: bytes, status: int) -> APIError:
    """The stable envelope for a worker's 4xx answer ``content`` with ``status``."""
    fields = _fields(content)
    message = fields.get("message")
    message = message if isinstance(message, str) and message else f"worker answered {status}"
    param = _param(fields.get("param"))
    upstream_code = fields.get("code")
    code = _STATUS_CODES.get(status, "invalid_request")
    if isinstance(upstream_code, str) and _SNAKE.match(upstream_code):
        code = upstream_code
    entry = _PYDANTIC_ENTRY.search(message)
    if entry is not None:
        if entry["type"].endswith(_TYPE_ERRORS):
            code = "invalid_type"
        message = f"'{param}': {entry['msg']}" if param else entry["msg"]
    return APIError(message, status=status, code=code, param=param,
                    type="rate_limit_error" if status == 429 else "invalid_request_error")


def stable_error_body(content: bytes, status: int) -> bytes:
    """:func:`upstream_api_error` serialised as the router serialises its own errors."""
    return json.dumps(upstream_api_error(content, status).to_dict(),
                      separators=(",", ":"), ensure_ascii=False).encode()
