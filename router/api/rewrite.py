"""How the client's body becomes the prefill body and the decode body (vLLM's P/D protocol)."""

from __future__ import annotations

from typing import Any

from router.api.fastjson import dumps
from router.api.schemas import Endpoint

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {"do_remote_decode": True}

HANDOFF_PRIORITY = -1
"""vLLM ``priority`` of a decode that pulls a prefill's KV (lower runs earlier): ahead of every
client request, whose priority the router keeps at 0 or above (``router.api.untrusted``).
pdserve's workers schedule by priority (``serve.worker.vllm_command``), so a handoff is
allocated and starts its pull at the engine's next step instead of queueing behind the
prefills a flex or decode engine already has waiting (FCFS kept it there for 0.2-0.85 s at
1.5 req/s of prefill_heavy on two flex engines). Under FCFS vLLM ignores it."""


def prefill_body(endpoint: Endpoint, body: dict[str, Any], *,
                 token_ids: bool = False) -> dict[str, Any]:
    """The same request capped at one token, non-streaming, asking P to keep the KV blocks
    (``token_ids``: and to return the prompt's and the sampled token's ids)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    if token_ids:
        out["return_token_ids"] = True
    out["max_tokens"] = 1
    if endpoint.chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The original request plus the prefill worker's ``kv_transfer_params``, scheduled as a
    handoff (:data:`HANDOFF_PRIORITY`)."""
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    out["priority"] = HANDOFF_PRIORITY
    return out


def encode(body: dict[str, Any]) -> bytes:
    """A body as compact UTF-8 JSON (``router.api.fastjson``)."""
    return dumps(body)
