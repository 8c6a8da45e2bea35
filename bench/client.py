"""Open-loop streaming client: each request is sent at its scheduled time, whatever came before.

Every request body is built and JSON-encoded before the clock starts; then one asyncio task
sleeps until each request's offset and starts it as its own task, so a slow response never
delays later sends and the send loop does no per-request work beyond starting that task. With
``max_concurrency`` N (``vllm bench serve --max-concurrency``) at most N requests are in flight:
a request whose time has come waits for a slot, and that wait is recorded as its
``queue_s`` (vLLM's ``client_queue_time``), apart from its schedule lag.

Each request streams SSE from ``/v1/completions`` (or ``/v1/chat/completions``) with
``max_tokens`` = the trace's response tokens and ``ignore_eos``; the arrival time of every
content chunk is recorded. A response whose tokens all decode to no text (on the tiny model, a
lone byte of a multi-byte character, which the server holds back) streams no content chunk,
only its finish chunk; when the server's usage counts tokens, that chunk's arrival is its
token time (a late bound on its first token), not a failure. Timeouts, HTTP errors and error
events are recorded on the result, never raised. Schedule lag (actual send - scheduled time -
slot wait) is recorded per request so a run can show the client was not the bottleneck.

Times are ``time.perf_counter()`` seconds relative to the run start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    index: int
    at_s: float
    """Scheduled send time, seconds after the run starts."""
    prompt: str
    prompt_tokens: int
    max_tokens: int
    session_id: str | None = None
    log_type: str = ""
    trace_line: int = 0


@dataclass
class RequestResult:
    """What happened to one request; token times are seconds after its send."""

    index: int
    scheduled_s: float
    prompt_tokens: int
    max_tokens: int
    sent_s: float = float("nan")
    lag_s: float = float("nan")
    """Send delay the client caused: ``sent_s - scheduled_s - queue_s``."""
    queue_s: float = 0.0
    """Time spent waiting for a ``max_concurrency`` slot (0 without a cap)."""
    token_times_s: list[float] = field(default_factory=list)
    end_s: float = float("nan")
    """End of the stream (or of the failure) after send."""
    output_tokens: int = 0
    """Completion tokens from the server's usage record, else the number of content chunks."""
    server_prompt_tokens: int | None = None
    ok: bool = False
    error_type: str = ""
    error: str = ""
    status_code: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.ok and self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times_s[-1] if self.ok and self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), vLLM's definition; None for one-token outputs."""
        if not self.ok or not self.token_times_s or self.output_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)] if self.ok else []


@dataclass(frozen=True)
class ClientConfig:
    """How requests are sent."""

    url: str
    """Base URL of an OpenAI-compatible server, e.g. ``http://127.0.0.1:8000``."""
    model: str
    endpoint: str = "completions"
    """``completions`` or ``chat``."""
    timeout_s: float = 300.0
    """Per-request limit on the whole stream."""
    connect_timeout_s: float = 10.0
    ignore_eos: bool = True
    max_connections: int = 4096
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    max_concurrency: int | None = None
    """At most this many requests in flight (closed loop at the cap); None: no cap."""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class RunResult:
    """All results of one open-loop run."""

    results: list[RequestResult]
    started_wall: float
    """Unix time of the run start."""
    duration_s: float
    """From run start to the last request's end."""


def _body(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": spec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(cfg.extra_body)
    return body


def _chunk_has_content(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return bool(delta and (delta.get("content") or delta.get("reasoning_content")))


_JSON = {"content-type": "application/json"}


async def _send_when_free(client: httpx.AsyncClient, cfg: ClientConfig, path: str,
                          content: bytes, spec: RequestSpec, res: RequestResult, t0: float,
                          slots: asyncio.Semaphore) -> None:
    due = time.perf_counter()
    async with slots:
        res.queue_s = time.perf_counter() - due
        await _send(client, cfg, path, content, spec, res, t0)


async def _send(client: httpx.AsyncClient, cfg: ClientConfig, path: str, content: bytes,
                spec: RequestSpec, res: RequestResult, t0: float) -> None:
    sent = time.perf_counter()
    res.sent_s = sent - t0
    res.lag_s = res.sent_s - spec.at_s - res.queue_s
    times = res.token_times_s
    chunks = 0
    finished_at: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with client.stream("POST", path, content=content,
                                     headers={**_JSON, "x-request-id": f"bench-{spec.index}"}
                                     ) as resp:
                res.status_code = resp.status_code
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")
                    res.error_type, res.error = f"http_{resp.status_code}", text[:500]
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        err = event["error"]
                        res.error_type = "stream_error"
                        res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                        return
                    choices = event.get("choices") or ()
                    if choices and _chunk_has_content(choices[0]):
                        times.append(now - sent)
                        chunks += 1
                    elif choices and choices[0].get("finish_reason"):
                        finished_at = now - sent
                    if event.get("usage"):
                        usage = event["usage"]
        if usage:
            res.output_tokens = int(usage.get("completion_tokens") or chunks)
            res.server_prompt_tokens = usage.get("prompt_tokens")
        else:
            res.output_tokens = chunks
        if not times and finished_at is not None and res.output_tokens > 0:
            times.append(finished_at)
        if not times:
            res.error_type, res.error = "no_output", "stream ended without a token"
            return
        res.ok = True
    except TimeoutError:
        res.error_type, res.error = "timeout", f"no complete response within {cfg.timeout_s} s"
    except httpx.ConnectError as exc:
        res.error_type, res.error = "connect_error", str(exc)
    except httpx.HTTPError as exc:
        res.error_type, res.error = type(exc).__name__, str(exc)
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON or event
        res.error_type, res.error = "bad_response", f"{type(exc).__name__}: {exc}"
    finally:
        res.end_s = time.perf_counter() - sent


async def run_open_loop(specs: Sequence[RequestSpec], cfg: ClientConfig, *,
                        on_done: Callable[[RequestResult], None] | None = None) -> RunResult:
    """Send ``specs`` at their ``at_s`` offsets (at most ``cfg.max_concurrency`` in flight)
    and wait for all of them."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    limits = httpx.Limits(max_connections=cfg.max_connections,
                          max_keepalive_connections=cfg.max_connections)
    timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
    ordered = sorted(specs, key=lambda s: s.at_s)
    results = [RequestResult(s.index, s.at_s, s.prompt_tokens, s.max_tokens) for s in ordered]
    bodies = [json.dumps(_body(cfg, s), ensure_ascii=False).encode() for s in ordered]
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), limits=limits, timeout=timeout,
                                 headers=headers) as client:
        tasks: list[asyncio.Task[None]] = []

        def done(task: asyncio.Task[None], res: RequestResult) -> None:
            if on_done is not None:
                on_done(res)

        started_wall = time.time()
        t0 = time.perf_counter()
        for spec, res, content in zip(ordered, results, bodies, strict=True):
            delay = spec.at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(
                _send(client, cfg, path, content, spec, res, t0) if slots is None else
                _send_when_free(client, cfg, path, content, spec, res, t0, slots))
            task.add_done_callback(lambda t, r=res: done(t, r))  # type: ignore[misc]
            tasks.append(task)
            if delay <= 0 and len(tasks) % 64 == 0:
                await asyncio.sleep(0)  # let started requests write while we are behind
        await asyncio.gather(*tasks)
        end = max((r.sent_s + r.end_s for r in results), default=0.0)
    results.sort(key=lambda r: r.index)
    return RunResult(results, started_wall, end)
