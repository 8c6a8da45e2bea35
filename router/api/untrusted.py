"""What a client body may not be or hold, refused up front: more bytes than the router takes,
more time than it waits for them, and fields that only the router (or an operator) may set
(a negative ``priority`` included: that is the rank of the router's KV handoffs).

vLLM reads several of them from more than one place: ``kv_transfer_params`` also from
``vllm_xargs`` (a string there used to crash the worker's engine core), and a Jinja chat
template from ``chat_template`` or ``chat_template_kwargs.chat_template``, which vLLM itself
refuses unless started with ``--trust-request-chat-template`` (CVE-2025-61620: a template runs
on the server). The router renders templates too, so it must refuse them before rendering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from router.errors import APIError, InvalidRequestError

ROUTER_ONLY_FIELDS = ("kv_transfer_params", "ec_transfer_params")
"""Top-level fields the router sets on the upstream calls it makes."""

WORKER_ONLY_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")
"""``vllm_xargs`` keys vLLM copies into the engine's per-request state."""

TEMPLATE_CALL_KWARGS = frozenset({
    "chat_template", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "continue_final_message",
    "add_generation_prompt", "conversation", "documents", "tools",
})
"""``apply_chat_template`` arguments that are not template variables: a client may not set
them through ``chat_template_kwargs`` (the template is the server's, the call is the router's)."""

def refuse_worker_only_fields(body: Mapping[str, Any]) -> None:
    """Raise a 400 when ``body`` sets anything a client may not (see the module docstring)."""
    for name in ROUTER_ONLY_FIELDS:
        if name in body:
            raise InvalidRequestError(f"{name} is set by the router, not by clients",
                                      code="invalid_parameter", param=name)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping):
        for name in WORKER_ONLY_XARGS:
            if name in xargs:
                raise InvalidRequestError(f"vllm_xargs.{name} is set by the router, not by "
                                          "clients", code="invalid_parameter",
                                          param=f"vllm_xargs.{name}")
    priority = body.get("priority")
    if priority is not None and (type(priority) is not int or priority < 0):
        # below 0 is the router's: its KV handoffs run ahead of every client request
        raise InvalidRequestError(f"priority must be an integer of 0 or more (lower runs "
                                  f"earlier; negative values are the router's), got "
                                  f"{priority!r}", code="invalid_parameter", param="priority")
    if body.get("chat_template") is not None:
        raise _untrusted_template("chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise InvalidRequestError("chat_template_kwargs must be an object",
                                      code="invalid_type", param="chat_template_kwargs")
        if kwargs.get("chat_template") is not None:
            raise _untrusted_template("chat_template_kwargs.chat_template")
        reserved = sorted(TEMPLATE_CALL_KWARGS.intersection(kwargs) - {"chat_template"})
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may only hold template variables, not {reserved}",
                code="invalid_parameter", param=f"chat_template_kwargs.{reserved[0]}")


def _untrusted_template(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        "a chat template is passed with the request; this server renders only its own "
        "templates (refused request with untrusted chat template)",
        code="untrusted_chat_template", param=param)


async def read_capped_body(request: Request, limit: int, timeout_s: float = 0.0) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed ``limit`` bytes:
    from ``Content-Length`` before reading, else while it streams in (a chunked upload of
    gigabytes is never held in memory); and with a 408 when it has not finished arriving
    ``timeout_s`` after the read began (0 = no deadline), so a client trickling its body holds
    nothing for long (the connection then closes: ``router.http_protocol``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise _too_slow(size, timeout_s) from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> InvalidRequestError:
    return InvalidRequestError(f"request body of {size}+ bytes exceeds the limit of {limit}",
                               code="request_too_large", status=413)


def _too_slow(received: int, timeout_s: float) -> APIError:
    # `connection: close`: the rest of the body would otherwise be parsed on this connection
    return APIError(f"the request body did not finish arriving within {timeout_s:g} s "
                    f"({received} bytes received)", status=408, code="request_timeout",
                    headers={"connection": "close"})
