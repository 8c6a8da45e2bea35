"""A fast fake vLLM OpenAI server: the backend of ``python -m bench.router_overhead``.

    python -m bench.fake_openai --port 8100 [--model fake] [--chunk-gap-ms 0]

Raw asyncio (uvloop when installed), HTTP/1.1 keep-alive, no framework, so that a router in
front of it is what costs. It answers what a router asks of a vLLM worker:

- ``POST /v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` tokens (16 unless the
  request says), streamed as SSE when ``stream`` is true, one HTTP chunk per event as vLLM's
  uvicorn sends them, each event in vLLM 0.32's exact shape (:func:`stream_events`: the same
  keys in the same order and the same nulls; ``return_token_ids`` and
  ``stream_options.include_usage`` honoured); a whole JSON answer otherwise;
- ``GET /v1/models``, ``GET /health`` (200), ``GET /metrics`` (vLLM's load gauges, all 0: the
  router's load poller reads them).

``--chunk-gap-ms`` spaces the stream's events (0: each event is still its own write, and the
stream yields to the event loop between them, so concurrent streams interleave). Pure event
builders first, the server after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

DEFAULT_TOKENS = 16
CREATED = 1_700_000_000
"""The ``created`` of every answer (vLLM stamps the request's arrival; any int reads alike)."""
GENERATED_ID_BASE = 1000
"""The id of generated token ``i`` is ``GENERATED_ID_BASE + i``; its text is ``" w{i}"``."""

_DONE = b"data: [DONE]\n\n"


def _dumps(data: Any) -> str:
    """Compact JSON, as pydantic's ``model_dump_json`` writes it."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {_dumps(data)}\n\n".encode()


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """Stand-in ids of the request's prompt: one per 4 bytes of its text (a list prompt of
    ids is its own)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if prompt is None:
        prompt = _dumps(body.get("messages") or [])
    text = prompt if isinstance(prompt, str) else _dumps(prompt)
    return list(range(1, 2 + len(text.encode()) // 4))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def stream_events(*, chat: bool, model: str, response_id: str, tokens: int,
                  prompt: Sequence[int], token_ids: bool, include_usage: bool) -> list[bytes]:
    """The SSE events (``data: ...\\n\\n``, ``[DONE]`` last) vLLM 0.32 streams for a request
    that generates ``tokens`` tokens and stops at its cap (``finish_reason`` ``length``), with
    the prompt's and each token's ids when ``token_ids`` (``return_token_ids``) and a final
    usage event when ``include_usage``."""
    head = {"id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": CREATED, "model": model}
    events: list[bytes] = []
    if chat:  # the role first, with the prompt's ids
        events.append(_event({**head, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}],
            "prompt_token_ids": list(prompt) if token_ids else None, "prompt_text": None}))
    for i in range(tokens):
        last = i == tokens - 1
        ids = [GENERATED_ID_BASE + i] if token_ids else None
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice.update(delta={"content": f" w{i}"}, logprobs=None,
                          finish_reason="length" if last else None)
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = ids
        else:
            choice.update(text=f" w{i}", logprobs=None, finish_reason="length" if last else None,
                          stop_reason=None,
                          prompt_token_ids=list(prompt) if token_ids and i == 0 else None,
                          token_ids=ids)
        events.append(_event({**head, "choices": [choice]}))
    if include_usage:
        events.append(_event({**head, "choices": [], "usage": _usage(len(prompt), tokens)}))
    events.append(_DONE)
    return events


def whole_answer(*, chat: bool, model: str, response_id: str, tokens: int,
                 prompt: Sequence[int]) -> dict[str, Any]:
    """vLLM 0.32's non-streamed answer of the same request."""
    text = "".join(f" w{i}" for i in range(tokens))
    usage = {**_usage(len(prompt), tokens), "prompt_tokens_details": None,
             "completion_tokens_details": None}
    tail = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    if chat:
        return {"id": response_id, "object": "chat.completion", "created": CREATED,
                "model": model, "choices": [{
                    "index": 0, "message": {
                        "role": "assistant", "content": text, "refusal": None,
                        "annotations": None, "audio": None, "function_call": None,
                        "reasoning": None},
                    "logprobs": None, "finish_reason": "length", "stop_reason": None,
                    "token_ids": None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": None, "usage": usage,
                "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, **tail}
    return {"id": response_id, "object": "text_completion", "created": CREATED,
            "model": model, "choices": [{
                "index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                "prompt_token_ids": None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage, **tail}


def metrics_text(model: str) -> str:
    """vLLM's load gauges (what ``router.state.worker_load`` reads), all idle."""
    labels = f'engine="0",model_name="{model}"'
    lines = []
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        lines += [f"# HELP {name} {name}", f"# TYPE {name} gauge", f"{name}{{{labels}}} 0.0"]
    return "\n".join(lines) + "\n"


# -- the server ----------------------------------------------------------------------------------

def _head(status: str, ctype: str, length: int | None) -> bytes:
    framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    return (f"HTTP/1.1 {status}\r\nserver: fake-vllm\r\ncontent-type: {ctype}\r\n"
            f"{framing}\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Request:
    __slots__ = ("method", "path", "body")

    def __init__(self, method: str, path: str, body: bytes) -> None:
        self.method, self.path, self.body = method, path, body


def parse_requests(buf: bytearray) -> list[_Request]:
    """Take every complete HTTP/1.1 request off the front of ``buf`` (a body framed by
    ``content-length`` or chunked)."""
    out: list[_Request] = []
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return out
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length, chunked = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        start = end + 4
        if chunked:
            body, used = _dechunk(buf, start)
            if body is None:
                return out
            del buf[:used]
        else:
            if len(buf) < start + length:
                return out
            body = bytes(buf[start:start + length])
            del buf[:start + length]
        out.append(_Request(method, path.split("?", 1)[0], body))


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes | None, int]:
    """A chunked body starting at ``pos``: (body, bytes used up to its end), or (None, 0)
    while incomplete."""
    parts: list[bytes] = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        if size == 0:
            trailer = buf.find(b"\r\n\r\n", eol)
            if buf[eol:eol + 4] == b"\r\n\r\n":
                return b"".join(parts), eol + 4
            if trailer < 0:
                return None, 0
            return b"".join(parts), trailer + 4
        if len(buf) < eol + 2 + size + 2:
            return None, 0
        parts.append(bytes(buf[eol + 2:eol + 2 + size]))
        pos = eol + 2 + size + 2


class FakeServer:
    """What every connection shares: the model name, the stream pacing, the id counter."""

    def __init__(self, model: str, chunk_gap_s: float) -> None:
        self.model = model
        self.chunk_gap_s = chunk_gap_s
        self.ids = itertools.count()
        self.models = json.dumps({"object": "list", "data": [
            {"id": model, "object": "model", "created": CREATED, "owned_by": "vllm",
             "root": model, "parent": None, "max_model_len": 4096}]}).encode()
        self.metrics = metrics_text(model).encode()


class _Connection(asyncio.Protocol):
    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.queue: list[_Request] = []
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.queue += parse_requests(self.buf)
        self._next()

    def _next(self) -> None:
        while self.queue and not self.busy and self.transport is not None:
            self._answer(self.queue.pop(0))

    def _send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _answer(self, req: _Request) -> None:
        srv = self.server
        if req.method == "GET":
            if req.path == "/health":
                self._send(_head("200 OK", "application/json", 0))
            elif req.path == "/metrics":
                self._send(_head("200 OK", "text/plain; version=0.0.4", len(srv.metrics))
                           + srv.metrics)
            elif req.path.startswith("/v1/models"):
                self._send(_head("200 OK", "application/json", len(srv.models)) + srv.models)
            else:
                self._send(_head("404 Not Found", "application/json", 0))
            return
        chat = req.path == "/v1/chat/completions"
        if req.method != "POST" or not (chat or req.path == "/v1/completions"):
            self._send(_head("404 Not Found", "application/json", 0))
            return
        try:
            body = json.loads(req.body)
        except ValueError:
            err = b'{"error":{"message":"bad JSON","type":"BadRequestError","param":null,' \
                  b'"code":400}}'
            self._send(_head("400 Bad Request", "application/json", len(err)) + err)
            return
        n = next(srv.ids)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{n:032x}"
        tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_TOKENS
        prompt = prompt_ids(body)
        if not body.get("stream"):
            raw = json.dumps(whole_answer(chat=chat, model=body.get("model", srv.model),
                                          response_id=rid, tokens=tokens, prompt=prompt),
                             separators=(",", ":")).encode()
            self._send(_head("200 OK", "application/json", len(raw)) + raw)
            return
        options = body.get("stream_options") or {}
        events = stream_events(chat=chat, model=body.get("model", srv.model), response_id=rid,
                               tokens=tokens, prompt=prompt,
                               token_ids=body.get("return_token_ids") is True,
                               include_usage=bool(options.get("include_usage")))
        self.busy = True
        self._send(_head("200 OK", "text/event-stream; charset=utf-8", None))
        asyncio.get_running_loop().create_task(self._stream(events))

    async def _stream(self, events: list[bytes]) -> None:
        gap = self.server.chunk_gap_s
        for event in events:
            await asyncio.sleep(gap)
            if self.transport is None:
                return
            self._send(_chunk(event))
        self._send(b"0\r\n\r\n")
        self.busy = False
        self._next()


async def serve(host: str, port: int, model: str, chunk_gap_s: float = 0.0) -> None:
    """Serve until cancelled."""
    shared = FakeServer(model, chunk_gap_s)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(shared), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def event_loop_runner() -> Any:
    """``asyncio.run`` on uvloop when it is installed (cheaper per event), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fake_openai",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--chunk-gap-ms", type=float, default=0.0,
                    help="pause before each streamed event (default 0: yield only)")
    ap.add_argument("--cpu", type=int, action="append",
                    help="run on this core (repeatable; default: anywhere)")
    args = ap.parse_args(argv)
    if args.cpu:
        os.sched_setaffinity(0, set(args.cpu))
    with contextlib.suppress(KeyboardInterrupt):
        event_loop_runner()(serve(args.host, args.port, args.model, args.chunk_gap_ms / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
