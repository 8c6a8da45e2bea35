"""One client stream across the workers that serve it: what it was sent, and the rewriting that
makes every upstream source look like one stream.

A stream that can move to another worker (``first_token.resumable``) is asked of its worker with
``return_token_ids``: every event then names the token ids it carries. The journal reads each
event the worker sends and

- keeps the ids whose text reached the client (``committed``; ids whose text the worker's
  detokenizer still holds back, half a UTF-8 character, wait in ``pending`` and are regenerated
  by a continuation, never shown twice);
- relays the event without the ids (the fields read ``null``, as in a plain answer);
- notices how the source ended: a ``finish_reason`` then ``[DONE]`` (``done``), an error event
  (``error``: kept from the client, the stream moves on), or nothing (``done`` stays False: a
  ``[DONE]`` before any finish is kept from the client too).

A *continuation* (``continuation_body``) asks a worker, on ``/v1/completions``, to go on from the
prompt's ids plus the committed ids: exactly what an engine that had sampled those ids does next.
Its events are rewritten under the stream's id (chat requests get chat chunks) and its usage
counts the carried ids as output, not prompt. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.api.fastjson import dumps, loads
from router.api.rewrite import decode_body
from router.api.schemas import Endpoint

SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "ignore_eos", "stop_token_ids",
                   "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
                   "include_stop_str_in_output", "min_tokens", "user", "seed", "cache_salt"}
"""Request fields that mean the same for a continuation as for the whole request
(``cache_salt``: the continuation's prompt starts with the request's, so its blocks must be
hashed under the same salt, ``router.api.cache_salt``)."""


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    """The request's output cap (chat's ``max_completion_tokens`` first), if it set one."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) else None


def continuation_body(body: Mapping[str, Any], prompt_ids: Sequence[int],
                      generated: Sequence[int], kv_transfer_params: dict[str, Any] | None, *,
                      token_ids: bool = False) -> dict[str, Any]:
    """The ``/v1/completions`` request that goes on from ``prompt_ids`` + ``generated`` for
    what is left of ``body``'s output (``kv_transfer_params``: the prefill's, None: the worker
    computes the prompt itself; ``token_ids``: ask for the ids of every event)."""
    out: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    out["model"] = body["model"]
    out["prompt"] = [*prompt_ids, *generated]
    max_tokens = max_tokens_of(body)
    if max_tokens is not None:
        out["max_tokens"] = max_tokens - len(generated)
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - len(generated))
    out["stream"] = True
    if body.get("stream_options") is not None:
        out["stream_options"] = body["stream_options"]
    if token_ids:
        out["return_token_ids"] = True
    if kv_transfer_params is not None:  # a handoff, as the first decode call is
        return decode_body(out, kv_transfer_params)
    if "priority" in body:  # the client's own, as on its first worker
        out["priority"] = body["priority"]
    return out


def sse_event(data: dict[str, Any]) -> bytes:
    """One compact SSE ``data:`` event."""
    return b"data: " + dumps(data) + b"\n\n"


def _text(choice: Mapping[str, Any]) -> str:
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content") or delta.get("reasoning_content")
        return content if isinstance(content, str) else ""
    return ""


class StreamJournal:
    """The ids a client stream was sent and the rewriting of each source's events (see the
    module docstring). ``begin`` each source (the client's own request, or a continuation),
    ``feed`` it every chunk the worker sends and relay what comes back."""

    def __init__(self, endpoint: Endpoint, body: Mapping[str, Any], *,
                 prompt_ids: Sequence[int] = (), committed: Sequence[int] = (),
                 response_id: str | None = None) -> None:
        self.endpoint = endpoint
        self.body = body
        self.prompt_ids: tuple[int, ...] = tuple(prompt_ids)
        """The prompt's ids as the engine tokenized it (from the first event, or the prefill)."""
        self.committed: list[int] = list(committed)
        """Generated ids whose text reached the client."""
        self.pending: list[int] = []
        """Ids of the current source whose text has not appeared yet."""
        self.response_id = response_id
        self.finished = False
        """An event with a ``finish_reason`` was relayed."""
        self.done = False
        """The stream's ``[DONE]`` was relayed after its finish: it is complete."""
        self.error: str | None = None
        """The current source's error event (not relayed), if it sent one."""
        self.exact = True
        """Every text the client was shown came with its ids (a worker that ignores
        ``return_token_ids`` sends none: its stream cannot be continued)."""
        self.relayed: list[dict[str, Any]] = []
        """The decoded events the last ``feed`` or ``flush`` returned, as the client gets them
        (so a reader of the stream need not parse them again); ``[DONE]`` is ``done``."""
        self._buf = b""
        self._carried = 0
        self._native = True

    def begin(self, *, native: bool) -> None:
        """A new source starts: ``native`` (the client's own request, on its own endpoint) or a
        continuation from the committed ids."""
        self._buf = b""
        self.pending = []
        self.error = None
        self._native = native
        self._carried = 0 if native else len(self.committed)

    @property
    def resumable(self) -> bool:
        """Whether a continuation can go on from here: the prompt's ids are known and so is
        every id shown so far."""
        return bool(self.prompt_ids) and self.exact

    def remaining(self) -> int | None:
        """Output tokens left to generate (None: the request set no cap)."""
        cap = max_tokens_of(self.body)
        return None if cap is None else cap - len(self.committed)

    def continuation(self, kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The request that goes on from what the client has (see ``continuation_body``)."""
        return continuation_body(self.body, self.prompt_ids, self.committed,
                                 kv_transfer_params, token_ids=True)

    def feed(self, chunk: bytes) -> bytes:
        """Rewrite every complete event in ``chunk`` (a partial event waits for the rest)."""
        if not self._buf and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            events = chunk.split(b"\n\n")  # whole events, as a worker sends them
            events.pop()
        else:
            self._buf += chunk.replace(b"\r\n", b"\n")
            *events, self._buf = self._buf.split(b"\n\n")
        self.relayed = []
        if len(events) == 1:
            return self._rewrite(events[0]) if events[0].strip() else b""
        return b"".join([self._rewrite(e) for e in events if e.strip()])

    def flush(self) -> bytes:
        """Whatever is left when the source ends."""
        rest, self._buf = self._buf, b""
        self.relayed = []
        return self._rewrite(rest) if rest.strip() else b""

    def finish_event(self) -> bytes:
        """The end of a stream whose cap was reached by committed ids alone (nothing left to
        continue): a ``length`` finish, then ``[DONE]``."""
        self.finished = self.done = True
        head = {"id": self.response_id or "", "model": self.body.get("model")}
        data: dict[str, Any]
        if self.endpoint.chat:
            data = {**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "token_ids": None}]}
        else:
            data = {**head, "object": "text_completion", "choices": [
                {"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]}
        return sse_event(data) + b"data: [DONE]\n\n"

    # -- one event ---------------------------------------------------------------------------

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data:"):
            return event + b"\n\n"
        payload = event[5:].strip()
        if payload == b"[DONE]":
            if not self.finished:  # ended with no finish (``done`` stays False): truncated
                return b""
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            data = loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(data, dict):
            return event + b"\n\n"
        if "error" in data:
            error = data["error"]
            self.error = str(error.get("message") if isinstance(error, dict) else error)[:500]
            return b""
        changed = self._read_ids(data)
        if self._native:
            if self.response_id is None:
                self.response_id = str(data.get("id", ""))
            self.relayed.append(data)
            # an event that carried no ids is relayed byte for byte
            return sse_event(data) if changed else event + b"\n\n"
        return self._continued(data)

    def _read_ids(self, data: dict[str, Any]) -> bool:
        """Record the event's ids and take them out of it; True when it carried some."""
        changed = self._take_prompt_ids(data)  # chat: on the first chunk
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            changed = self._take_prompt_ids(choice) or changed  # completions: first chunk
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.pending += [int(t) for t in ids]
                choice["token_ids"] = None
                changed = True
            elif _text(choice):
                self.exact = False
            if _text(choice) or choice.get("finish_reason"):
                self.committed += self.pending
                self.pending = []
            if choice.get("finish_reason"):
                self.finished = True
        return changed

    def _take_prompt_ids(self, part: dict[str, Any]) -> bool:
        """Read (from a native source) and null ``part``'s ``prompt_token_ids``, if any."""
        ids = part.get("prompt_token_ids")
        if ids is None:
            return False
        if self._native and isinstance(ids, list) and ids and not self.prompt_ids:
            self.prompt_ids = tuple(int(t) for t in ids)
        part["prompt_token_ids"] = None
        return True

    def _continued(self, data: dict[str, Any]) -> bytes:
        """A continuation's completion event as the client's stream event."""
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= self._carried
            usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + \
                self._carried
        if self.response_id is not None:
            data["id"] = self.response_id
        if self.endpoint.chat:
            choices = [c for c in data.get("choices") or [] if isinstance(c, dict)]
            if choices and not any(_text(c) or c.get("finish_reason") for c in choices):
                return b""  # ids whose text is held back: nothing for a chat client yet
            data = _chat_chunk(data, choices)
        self.relayed.append(data)
        return sse_event(data)


def _chat_chunk(data: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A continuation's completion chunk as the chat chunk a plain vLLM streams: the same keys
    in the same order (``stop_reason`` only on a finish, ``token_ids`` null, per-chunk usage
    with ``completion_tokens_details``)."""
    chunk: dict[str, Any] = {"id": data.get("id"), "object": "chat.completion.chunk",
                             "created": data.get("created"), "model": data.get("model"),
                             "choices": []}
    for c in choices:
        choice: dict[str, Any] = {
            "index": c.get("index", 0), "delta": {"content": c["text"]} if c.get("text") else {},
            "logprobs": None, "finish_reason": c.get("finish_reason")}
        if c.get("finish_reason"):
            choice["stop_reason"] = c.get("stop_reason")
        choice["token_ids"] = None
        chunk["choices"].append(choice)
    usage = data.get("usage")
    if isinstance(usage, dict):
        chunk["usage"] = {**usage, "completion_tokens_details": None} if choices else usage
    if "system_fingerprint" in data:
        chunk["system_fingerprint"] = data["system_fingerprint"]
    return chunk
