"""A fake vLLM OpenAI worker for router tests (fault injection, bad-request checks).

It records every request it receives, answers prefill calls with ``kv_transfer_params`` and
decode calls with a deterministic completion (streamed as SSE when asked), and can be switched
to fail on demand. Runs under uvicorn in a thread on a free loopback port.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvtransfer.protocol import Handshake
from kvtransfer.signing import Keyring
from router.state.registry import WorkerRecord
from serve.redis_server import free_port

Mode = Literal[
    "ok",              # normal behaviour
    "error_500",       # answer every request with HTTP 500
    "no_kv_params",    # prefill answers 200 without kv_transfer_params
    "die_mid_stream",  # stream two chunks, then drop the connection
    "stall_mid_stream",  # stream two chunks, then go silent
    "bad_request",     # answer 400 with an OpenAI error
    "stall",           # never answer (until the client gives up)
    "foreign_kv_params",  # prefill answers params naming another engine's UCX address
]

FAKE_CLUSTER_SECRET = "fake-cluster-secret-0123456789abcdef"
"""The secret fake workers sign their registrations with (routers started with it trust them)."""

FAKE_UCX_ADDRESS = b"fake"
"""What every fake worker registers (and, unless told otherwise, hands out) as its UCX address."""

DECODE_PIECES = ("Hello", " from", " the", " fake", " decoder", ".")
FAKE_PROMPT_IDS = (1, 2, 3, 4, 5, 6, 7)
"""The ids a fake worker says any text prompt has (``return_token_ids``)."""
GENERATED_ID_BASE = 100
"""The id of ``DECODE_PIECES[i]`` is ``GENERATED_ID_BASE + i``."""


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


STOP_TIMEOUT_S = 3.0
"""How long :meth:`ServerThread.stop` waits for uvicorn's shutdown (lifespan included)."""
STUCK_SERVERS: list[str] = []
"""Servers whose shutdown did not finish in time, with their event loop's tasks; the
integration conftest prints them at the end of the session (they are left running)."""


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:``port`` in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        # log_config=None: uvicorn must not re-run logging.dictConfig from a second thread
        # (racing with the test's logging it made shutdowns stall).
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                log_config=None, lifespan="on", timeout_graceful_shutdown=1,
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"uvicorn-{self.port}")

    def _run(self) -> None:
        """uvicorn's ``Server.run`` with the loop kept for :meth:`_tasks`."""
        with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
            self.loop = runner.get_loop()
            runner.run(self.server.serve())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to shut down; a shutdown still running after :data:`STOP_TIMEOUT_S` is
        recorded in :data:`STUCK_SERVERS` (it never finished in 10 s either when this waited
        that long) and left to the daemon thread."""
        self.server.should_exit = True
        self.thread.join(timeout=STOP_TIMEOUT_S)
        if self.thread.is_alive():
            STUCK_SERVERS.append(f"uvicorn on port {self.port} (test "
                                 f"{_current_test()}):\n{self._tasks()}")

    def _tasks(self) -> str:
        """The stacks of the server loop's pending tasks (read from another thread: best
        effort, for diagnosis only)."""
        if self.loop is None:
            return "(no loop)"
        for _ in range(5):
            try:
                tasks = list(asyncio.all_tasks(self.loop))
                break
            except RuntimeError:  # the set changed while we copied it
                continue
        else:
            return "(tasks unreadable)"
        out = io.StringIO()
        for task in tasks:
            print(f"task {task.get_name()}:", file=out)
            coro: Any = task.get_coro()
            while coro is not None:  # the await chain, outermost first
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    print(f"  {frame.f_code.co_filename}:{frame.f_lineno} "
                          f"{frame.f_code.co_name}", file=out)
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        return out.getvalue() or "(no pending task: the loop thread is blocked)"


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?")


@dataclass
class FakeWorker:
    """One fake prefill or decode worker."""

    worker_id: str
    role: Literal["prefill", "decode"]
    model: str = "tiny"
    model_path: str = "/nonexistent"
    max_model_len: int = 2048
    mode: Mode = "ok"
    requests: list[Recorded] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)
    """The exact bytes of each streamed response body this worker produced."""
    releases: list[dict[str, Any]] = field(default_factory=list)
    """``kv_transfer_params`` of the requests it refused as vLLM does (streamed beam search)
    before its engine: vLLM then frees the lease they name (``router.api.unspent``)."""
    gauges: dict[str, float] = field(default_factory=dict)
    """vLLM load gauges its ``/metrics`` reports (running, waiting, kv_usage; 0 when unset)."""
    metrics_status: int = 200
    """HTTP status of ``/metrics`` (anything but 200 answers an empty error body)."""
    cluster_secret: str | None = FAKE_CLUSTER_SECRET
    """Signs its registration (`record`); None: unsigned."""
    _server: ServerThread | None = None

    def __post_init__(self) -> None:
        self.app = self._build_app()

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url

    @property
    def engine_id(self) -> str:
        return f"engine-{self.worker_id}"

    def record(self) -> WorkerRecord:
        record = WorkerRecord(worker_id=self.worker_id, role=self.role, model=self.model,
                              model_path=self.model_path, http_url=self.url,
                              engine_id=self.engine_id,
                              ucx_address=base64.b64encode(FAKE_UCX_ADDRESS).decode(),
                              max_model_len=self.max_model_len, started_at=1_700_000_000.0)
        if self.cluster_secret is None:
            return record
        return record.signed(Keyring.parse(self.cluster_secret))

    def start(self, port: int | None = None) -> FakeWorker:
        """Serve (on ``port``, e.g. the one it had before a restart; default a free one)."""
        self._server = ServerThread(self.app, port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def reset(self) -> None:
        self.mode = "ok"
        self.requests.clear()
        self.releases.clear()
        self.sent.clear()
        self.gauges.clear()
        self.metrics_status = 200

    # -- responses -------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request) -> Response:
            body = json.loads(await request.body())
            if body.get("stream") and body.get("use_beam_search"):
                self.releases.append(body.get("kv_transfer_params") or {})
                return JSONResponse({"error": {"message": "Streaming is not currently "
                                               "supported with beam search",
                                               "type": "BadRequestError", "param": None,
                                               "code": 400}}, status_code=400)
            self.requests.append(Recorded(request.url.path, dict(request.headers), body))
            rid = request.headers.get("x-request-id", "none")
            chat = request.url.path.endswith("/chat/completions")
            if self.mode == "stall":
                await asyncio.sleep(3600)
            if self.mode == "error_500":
                return JSONResponse({"error": {"message": "injected failure", "type": "server",
                                               "param": None, "code": 500}}, status_code=500)
            if self.mode == "bad_request":
                return JSONResponse({"error": {"message": "injected bad request",
                                               "type": "BadRequestError", "param": None,
                                               "code": 400}}, status_code=400)
            if self.role == "prefill" and "kv_transfer_params" in body:
                return JSONResponse(self._prefill_answer(body, rid, chat))
            # a decode, or a prefill serving a whole request (role fallback, a moved stream)
            if body.get("stream"):
                return StreamingResponse(self._stream(body, rid, chat),
                                         media_type="text/event-stream")
            return JSONResponse(self._full_answer(body, rid, chat))

        async def metrics() -> Response:
            if self.metrics_status != 200:
                return Response(status_code=self.metrics_status)
            return Response(self._metrics_text(), media_type="text/plain; version=0.0.4")

        app.add_api_route("/v1/completions", handle, methods=["POST"])
        app.add_api_route("/v1/chat/completions", handle, methods=["POST"])
        async def health() -> Response:
            return Response(status_code=200)

        app.add_api_route("/metrics", metrics, methods=["GET"])
        app.add_api_route("/health", health, methods=["GET"])
        return app

    def _metrics_text(self) -> str:
        """vLLM's load gauges in its exposition format (names, labels, types)."""
        labels = f'engine="0",model_name="{self.model}"'
        lines = []
        for name, key in (("vllm:num_requests_running", "running"),
                          ("vllm:num_requests_waiting", "waiting"),
                          ("vllm:kv_cache_usage_perc", "kv_usage")):
            lines += [f"# HELP {name} {key}", f"# TYPE {name} gauge",
                      f"{name}{{{labels}}} {float(self.gauges.get(key, 0.0))}"]
        return "\n".join(lines) + "\n"

    def _prefill_answer(self, body: dict[str, Any], rid: str, chat: bool) -> dict[str, Any]:
        answer = self._full_answer(body, rid, chat, pieces=DECODE_PIECES[:1])
        if self.mode != "no_kv_params":
            answer["kv_transfer_params"] = self.kv_params(rid)
        return answer

    def kv_params(self, rid: str) -> dict[str, Any]:
        """What this prefill answers for request ``rid`` (its own engine and UCX address;
        another address in mode ``foreign_kv_params``)."""
        address = b"rogue" if self.mode == "foreign_kv_params" else FAKE_UCX_ADDRESS
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3], "remote_engine_id": self.engine_id,
                "remote_request_id": rid, "remote_num_tokens": 7,
                "remote_handshake": Handshake(self.engine_id, address, (), "fake").to_wire(),
                "remote_lease_token": "fake-lease-token"}

    def _full_answer(self, body: dict[str, Any], rid: str, chat: bool,
                     pieces: tuple[str, ...] = DECODE_PIECES) -> dict[str, Any]:
        text = "".join(pieces)
        usage = {"prompt_tokens": 7, "completion_tokens": len(pieces),
                 "total_tokens": 7 + len(pieces)}
        if chat:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        return {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                "created": 1_700_000_000, "model": body.get("model"), "choices": [choice],
                "usage": usage, "served_by": self.worker_id}

    async def _stream(self, body: dict[str, Any], rid: str, chat: bool) -> AsyncIterator[bytes]:
        sent = bytearray()
        self.sent.append(b"")
        index = len(self.sent) - 1

        def event(payload: dict[str, Any] | str) -> bytes:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            raw = f"data: {data}\n\n".encode()
            sent.extend(raw)
            self.sent[index] = bytes(sent)
            return raw

        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": f"cmpl-{rid}", "object": obj, "created": 1_700_000_000,
                "model": body.get("model")}
        ids = body.get("return_token_ids") is True
        # A continuation's prompt ends with the ids already generated (GENERATED_ID_BASE + i):
        # the fake goes on from there, so a moved stream stitches into DECODE_PIECES.
        raw = body.get("prompt")
        prompt: list[int] = raw if isinstance(raw, list) and all(
            isinstance(t, int) for t in raw) else []
        start = 0
        while start < len(prompt) and prompt[-1 - start] >= GENERATED_ID_BASE:
            start += 1
        prompt_tokens = len(prompt) if start else 7
        if chat:
            yield event({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                    "content": ""}}],
                         **({"prompt_token_ids": list(FAKE_PROMPT_IDS)} if ids else {})})
        for n, i in enumerate(range(start, len(DECODE_PIECES))):
            piece = DECODE_PIECES[i]
            if n == 2 and self.mode == "die_mid_stream":
                raise RuntimeError("injected decode worker death")
            if n == 2 and self.mode == "stall_mid_stream":
                await asyncio.sleep(3600)
            last = i == len(DECODE_PIECES) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
                if ids and n == 0:
                    choice["prompt_token_ids"] = prompt if start else list(FAKE_PROMPT_IDS)
            if ids:
                choice["token_ids"] = [GENERATED_ID_BASE + i]
            yield event({**base, "choices": [choice]})
            await asyncio.sleep(0)
        if (body.get("stream_options") or {}).get("include_usage"):
            made = len(DECODE_PIECES) - start
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": made,
                     "total_tokens": prompt_tokens + made}
            yield event({**base, "choices": [], "usage": usage})
        yield event("[DONE]")


def build_tiny_tokenizer(out_dir: str | Path) -> Path:
    """A small byte-level BPE tokenizer with a chat template, saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = ["the quick brown fox jumps over the lazy dog",
             "hello world, this is a tiny tokenizer for router tests",
             "prefill and decode run on separate workers"]
    tok.train_from_iterator(lines * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(out))
    return out
