"""What the router reads from the answers it relays: token usage and inter-token gaps.

The router never changes a relayed answer to read it: a non-streamed body is parsed once after
it arrived, a stream is read as it passes through (:class:`StreamWatch`). Usage is the OpenAI
``usage`` record the worker sent (streams carry it in their last event when the client asked
for ``stream_options.include_usage``, or when vLLM runs with ``--enable-force-include-usage``).
Pure: the caller passes the arrival time of every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.api.fastjson import loads


@dataclass(frozen=True)
class Usage:
    """Tokens of one answer, as its ``usage`` record counts them."""

    prompt_tokens: int
    completion_tokens: int


def usage_of(data: Any) -> Usage | None:
    """The ``usage`` of a decoded response or stream event, if it has a complete one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


def body_usage(body: bytes) -> Usage | None:
    """The ``usage`` of a non-streamed JSON answer (None when it has none or is not JSON)."""
    if b'"usage"' not in body:
        return None
    try:
        return usage_of(loads(body))
    except ValueError:
        return None


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events in ``buf`` (``\r\n`` framing normalised) and the unfinished rest."""
    *events, rest = buf.replace(b"\r\n", b"\n").split(b"\n\n")
    return events, rest


def has_content(data: dict[str, Any]) -> bool:
    """True when a stream event carries generated output (text, content, reasoning, tools)."""
    for choice in data.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                        or delta.get("tool_calls")):
            return True
    return False


class StreamWatch:
    """Reads an SSE stream chunk by chunk: the gap between each pair of consecutive content
    events (``gaps``, seconds, one fewer than the content events), the last usage record, and
    what an ending the router adds needs (``router.api.stream_end``): the stream's id, model
    and creation time, and which choices are still open."""

    _LIMIT = 1 << 20
    """Bytes kept without an event boundary before giving up on a non-SSE body."""

    def __init__(self) -> None:
        self._buf = b""
        self._last_content: float | None = None
        self.gaps: list[float] = []
        self.usage: Usage | None = None
        self.content_events = 0
        """Events that carried generated output."""
        self.head: dict[str, Any] = {}
        """The stream's ``id``, ``object``, ``created`` and ``model``, from its first event."""
        self.open_choices: set[int] = set()
        """Indexes of choices seen without their ``finish_reason`` yet."""
        self.finished_choices: set[int] = set()

    def feed(self, chunk: bytes, now: float) -> None:
        """Take the next relayed ``chunk``, which arrived at ``now`` (seconds, any origin)."""
        self._buf += chunk
        if b"\n\n" not in self._buf and b"\r\n\r\n" not in self._buf:
            if len(self._buf) > self._LIMIT:
                self._buf = b""
            return
        events, self._buf = split_events(self._buf)
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                data = loads(payload)
            except ValueError:
                continue
            if isinstance(data, dict):
                self.observe(data, now)

    def observe(self, data: dict[str, Any], now: float) -> None:
        """Take one relayed event already decoded (what ``feed`` does with each event's JSON;
        for a relay that decodes the events itself, so each is parsed once)."""
        usage = usage_of(data)
        if usage is not None:
            self.usage = usage  # continuous usage stats: the last one is the total
        self._choices(data)
        if has_content(data):
            self.content_events += 1
            if self._last_content is not None:
                self.gaps.append(now - self._last_content)
            self._last_content = now

    def _choices(self, data: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: data[k] for k in ("id", "object", "created", "model") if k in data}
        for choice in data.get("choices") or ():
            index = choice.get("index", 0) if isinstance(choice, dict) else None
            if not isinstance(index, int) or index in self.finished_choices:
                continue
            if choice.get("finish_reason"):
                self.open_choices.discard(index)
                self.finished_choices.add(index)
            else:
                self.open_choices.add(index)
