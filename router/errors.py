"""The router's exception tree.

::

    RouterError
    ├── ConfigError            bad settings; the message lists the allowed values
    ├── RegistryError          Redis unreachable or answered an error (wraps redis.RedisError)
    └── APIError               carries an OpenAI error envelope: status, code, type, param
        ├── InvalidRequestError    4xx raised by validation, before any worker is contacted
        └── UpstreamError          a worker failed (connect, timeout, 5xx, malformed answer)

Third-party exceptions (httpx, redis, pydantic) are mapped to these at the boundary with
``raise ... from exc``. "No candidate worker" is a return value of the policies, not an exception.
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """Root of every exception the router raises on purpose."""


class ConfigError(RouterError, ValueError):
    """Invalid router settings."""


class RegistryError(RouterError):
    """The worker registry (Redis) could not be read or written."""


class APIError(RouterError):
    """An error that is answered to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.type = type
        self.param = param
        self.headers = headers or {}
        """Extra response headers (``Retry-After`` of a 429)."""

    @property
    def public_message(self) -> str:
        """What the client is told (``message`` may carry details only logs should)."""
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.public_message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(APIError):
    """The client's request is malformed or cannot be served (4xx)."""

    def __init__(
        self, message: str, *, code: str, param: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message, status=status, code=code, type="invalid_request_error",
                         param=param)


class UpstreamError(APIError):
    """A prefill or decode worker failed; ``retryable`` says whether another worker may help."""

    def __init__(
        self,
        message: str,
        *,
        role: str,
        kind: str,
        status: int = 502,
        code: str = "upstream_error",
        retryable: bool = True,
    ) -> None:
        super().__init__(message, status=status, code=code, type="upstream_error")
        self.role = role
        self.kind = kind
        self.retryable = retryable

    @property
    def public_message(self) -> str:
        """The role and the kind of failure only: worker ids (host names) and the worker's own
        error text stay in the router's log (security review finding 21)."""
        return f"a {self.role} worker failed ({self.kind.replace('_', ' ')})"
