"""Upstream failures and the retry rules shared by the proxy's prefill and decode loops."""

from __future__ import annotations

import httpx

from router.errors import APIError, UpstreamError
from router.state.registry import WorkerRecord


def no_workers(role: str, model: str) -> APIError:
    """503: no live ``role`` worker serves ``model``."""
    return APIError(f"no live {role} worker for model '{model}'", status=503,
                    code="no_workers_available", type="service_unavailable")


def upstream_error(role: str, worker: WorkerRecord, exc: Exception) -> UpstreamError:
    """The retryable error an httpx failure talking to ``worker`` stands for."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(f"{role} worker {worker.worker_id} timed out: {exc!r}", role=role,
                             kind="timeout", status=504, code="upstream_timeout")
    kind = "connect" if isinstance(exc, httpx.ConnectError) else "protocol"
    return UpstreamError(f"{role} worker {worker.worker_id} failed: {exc!r}", role=role,
                         kind=kind)


# Failures that prove the request never reached the worker (nobody accepted the connection,
# or no connection was free): the worker cannot have pulled the prefill's KV.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def may_have_reached(exc: Exception | None) -> bool:
    """Whether a failed upstream call may have reached the worker (``None``: it answered,
    e.g. a 5xx). A decode reached with signed ``kv_transfer_params`` may have pulled and
    released the prefill's lease, so those params must not be sent again."""
    return not isinstance(exc, _NEVER_SENT)


# Errors of a pooled keep-alive connection the worker closed just as we reused it: the worker
# may be fine, so one retry on the same worker is allowed (useful when it is the only one).
_STALE_CONNECTION = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def allow_same_worker_retry(exc: Exception, worker: WorkerRecord, tried: set[str],
                            retried: set[str]) -> None:
    """After a stale pooled connection, let ``worker`` be tried once more."""
    if isinstance(exc, _STALE_CONNECTION) and worker.worker_id not in retried:
        retried.add(worker.worker_id)
        tried.discard(worker.worker_id)
