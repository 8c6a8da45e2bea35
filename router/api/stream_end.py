"""How a client stream that cannot go on ends (security review row 18).

Once a stream's 200 and first events are out, a failure can only be told inside the stream.
The router ends it with three events: a chunk that closes every choice still open with
``finish_reason`` ``"abort"``, one ``data: {"error": ...}`` event, and ``data: [DONE]``. A
client that reads only the choices (stops at a ``finish_reason`` or at ``[DONE]`` and skips
events it does not know) then still sees that the answer did not end normally. ``"abort"`` is
what vLLM itself streams for a request its engine aborted (vLLM 0.32 ``FinishReason.ABORT``);
its other abnormal reason, ``"error"``, vLLM never streams (it sends an error event instead),
and OpenAI's own set has no such reason, so clients built for either already meet ``abort``.
Pure: built from what :class:`~router.api.usage.StreamWatch` read of the stream.
"""

from __future__ import annotations

import json
from typing import Any

from router.api.usage import StreamWatch

ABORT = "abort"
"""The ``finish_reason`` of a choice the router had to end."""


def abort_chunk(watch: StreamWatch, *, chat: bool, model: str, response_id: str = "") -> bytes:
    """The SSE event closing every choice ``watch`` saw open with ``"abort"`` (choice 0 when
    it saw none); empty when every choice it saw has already finished. ``model`` and
    ``response_id`` stand in for what the stream did not show."""
    indexes = sorted(watch.open_choices)
    if not indexes:
        if watch.finished_choices:
            return b""
        indexes = [0]
    head = {"id": response_id, "model": model, **watch.head}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    choices: list[dict[str, Any]] = [
        {"index": i, "delta": {}, "logprobs": None, "finish_reason": ABORT} if chat else
        {"index": i, "text": "", "logprobs": None, "finish_reason": ABORT, "stop_reason": None}
        for i in indexes]
    return b"data: " + json.dumps({**head, "choices": choices}).encode() + b"\n\n"


def failed_ending(watch: StreamWatch, error: dict[str, Any], *, chat: bool, model: str,
                  response_id: str = "") -> bytes:
    """The end of a stream that failed for good: :func:`abort_chunk`, the ``error`` event
    (OpenAI's envelope: ``{"error": {...}}``) and ``[DONE]``."""
    return (abort_chunk(watch, chat=chat, model=model, response_id=response_id)
            + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
