"""Freeing the KV a prefill leased for a decode that will never read it (security review row 14).

A prefill keeps a finished prompt's blocks under a lease until a decode pulls and releases them
(``kvtransfer.leases``). When the router ends a request without handing the prefill's params to
a decode, nobody releases that lease and the blocks stay pinned for ``kv_lease_s`` (30 s): the
client left before the decode was started, no decode could take it, or the request finished on
another pool. Fire-and-forget streams would each pin a prompt's KV for the whole lease.

The router does not speak the KV control channel; a decode does, and vLLM already frees a
request's remote-prefill KV when its API server rejects the request before the engine sees it
(``_with_kv_transfer_rejection_cleanup``: the params are submitted again as a pre-aborted
request, and the connector answers that by releasing the lease with the lease token the params
carry). So the router sends the params, signed for one decode, in a request vLLM refuses before
any work (:func:`release_body`), and that decode releases the lease at once.

A release is one-shot and a read counts only if its own release is answered ok, so a release
the router sends while some decode does pull (it could not know) costs that decode a recompute,
never wrong output. Nothing here is on a request's path: releases run in the background,
bounded, and a release that cannot be sent leaves the lease to expire, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from router.api.rewrite import encode
from router.state.registry import WorkerRecord

logger = logging.getLogger(__name__)

MAX_PENDING = 512
"""Releases in flight at once; past it a release is dropped (its lease expires)."""
RELEASE_ID_SUFFIX = "-kv-release"
"""Appended to the request's id for the release request (never the id of a live request)."""
OUTCOMES = ("released", "refused", "no_decode", "failed", "dropped")
"""``released``: a decode took the params and vLLM rejected the request as meant (it frees
the lease); ``refused``: it answered otherwise; ``no_decode``: none was live; ``failed``: none
could be reached; ``dropped``: too many releases pending."""


def release_body(model: str, kv_params: dict[str, Any]) -> dict[str, Any]:
    """A completion vLLM's API server refuses before its engine (streamed beam search is not
    supported), carrying ``kv_transfer_params``: vLLM then frees what they pin. Should a vLLM
    ever serve it, it is one token of a one-token prompt, whose finish releases the lease too."""
    return {"model": model, "prompt": [0], "max_tokens": 1, "stream": True,
            "use_beam_search": True, "kv_transfer_params": kv_params}


class UnspentLeases:
    """Releases, in the background, the prefill leases of params no decode will read."""

    def __init__(self, client: Callable[[], httpx.AsyncClient],
                 decodes: Callable[[str], Sequence[WorkerRecord]],
                 sign: Callable[[dict[str, Any], WorkerRecord], dict[str, Any]],
                 headers: Callable[[str], dict[str, str]],
                 count: Callable[[str], None], timeout_s: float = 10.0) -> None:
        self._client = client
        self._decodes = decodes
        """Live decode workers of a model, best first."""
        self._sign = sign
        self._headers = headers
        """Headers of a worker call with this request id (the workers' key)."""
        self._count = count
        """Called with each release's outcome (one of :data:`OUTCOMES`)."""
        self._timeout = httpx.Timeout(timeout_s)
        self._pending: set[asyncio.Task[None]] = set()

    def release(self, model: str, request_id: str, kv_params: dict[str, Any]) -> None:
        """Free the lease ``kv_params`` describe (a prefill's answer to ``request_id``)."""
        if len(self._pending) >= MAX_PENDING:
            self._count("dropped")
            return
        task = asyncio.get_running_loop().create_task(
            self._release(model, request_id, kv_params))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, model: str, request_id: str, kv_params: dict[str, Any]) -> None:
        decodes = list(self._decodes(model))[:2]
        if not decodes:
            logger.info("request %s: no decode to release its prefill lease through (it "
                        "expires)", request_id)
            self._count("no_decode")
            return
        for worker in decodes:  # a second one only if the first cannot be reached
            body = release_body(model, self._sign(kv_params, worker))
            try:
                resp = await self._client().post(
                    worker.http_url + "/v1/completions", content=encode(body),
                    headers=self._headers(request_id + RELEASE_ID_SUFFIX),
                    timeout=self._timeout)
            except httpx.HTTPError as exc:
                logger.info("request %s: releasing its prefill lease through %s failed: %r",
                            request_id, worker.worker_id, exc)
                continue
            # 400: rejected before the engine, as meant; vLLM has handed the params back.
            outcome = "released" if resp.status_code == 400 else "refused"
            if outcome == "refused":
                logger.warning("request %s: decode %s answered %d to a lease release",
                               request_id, worker.worker_id, resp.status_code)
            self._count(outcome)
            return
        self._count("failed")

    @property
    def pending(self) -> int:
        """Releases not finished yet."""
        return len(self._pending)

    async def close(self) -> None:
        """Cancel the releases still running (their leases expire)."""
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
