"""The chaos runner's client: open-loop streaming requests, each classified by what happened.

Unlike ``bench.client`` (timings for SLO reports), this client keeps every request's text, can
misbehave on purpose (hang up mid-stream or before the first token, read slowly) and sorts each
request into exactly one outcome:

- ``completed``: the stream ended with ``[DONE]``, no error event, and every token asked for
  (its usage says ``max_tokens`` completion tokens: the load sets ``ignore_eos``);
- ``failed_clean``: the client was told: an HTTP error status, an error event, a stream shorter
  than asked, or a refused or reset connection (a process that is gone);
- ``aborted``: the client hung up on purpose (not judged);
- ``lost``: no response head by the deadline;
- ``hung``: the response started but did not finish by the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

BEHAVIOURS = ("normal", "abort_mid", "abort_early", "slow")
OUTCOMES = ("completed", "failed_clean", "aborted", "lost", "hung")


@dataclass
class Outcome:
    """What happened to one request."""

    index: int
    prompt_index: int
    behaviour: str
    outcome: str = ""
    text: str = ""
    error: str = ""
    sent_at: float = 0.0
    """Unix time of the send."""
    seconds: float = 0.0
    status: int = 0
    """HTTP status of the response head (0: none came)."""
    ttft_s: float | None = None
    """Seconds from the send to the first generated text."""
    tokens: int | None = None
    """Completion tokens the stream's usage reported."""

    @property
    def client_failure(self) -> bool:
        """Failed as the person waiting saw it (an overload 429 asks them to retry: not one)."""
        return self.outcome in ("failed_clean", "lost", "hung") and self.status != 429


@dataclass
class LoadConfig:
    """Shape of the chaos load."""

    url: str
    model: str
    prompts: Sequence[str]
    rate_per_s: float = 2.0
    max_tokens: int = 16
    deadline_s: float = 120.0
    slow_read_s: float = 0.2
    """Pause between chunk reads of a slow reader."""
    api_key: str | None = None


@dataclass
class ChaosLoad:
    """Sends Poisson arrivals until stopped; faults queue misbehaving clients with
    :meth:`misbehave`."""

    config: LoadConfig
    rng: random.Random
    outcomes: list[Outcome] = field(default_factory=list)
    _queued: list[str] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def misbehave(self, behaviour: str, count: int) -> None:
        """The next ``count`` requests behave like this (see ``BEHAVIOURS``)."""
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}; allowed: {BEHAVIOURS}")
        self._queued += [behaviour] * count

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` is set, then wait for every request to end."""
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        timeout = httpx.Timeout(cfg.deadline_s, connect=5.0)
        async with httpx.AsyncClient(base_url=cfg.url, timeout=timeout, headers=headers,
                                     trust_env=False,
                                     limits=httpx.Limits(max_connections=512)) as client:
            index = 0
            while not stop.is_set():
                behaviour = self._queued.pop(0) if self._queued else "normal"
                prompt_index = self.rng.randrange(len(cfg.prompts))
                out = Outcome(index, prompt_index, behaviour)
                self.outcomes.append(out)
                task = asyncio.create_task(self._one(client, out))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                index += 1
                gap = self.rng.expovariate(cfg.rate_per_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=gap)
            if self._tasks:
                await asyncio.gather(*self._tasks)

    async def _one(self, client: httpx.AsyncClient, out: Outcome) -> None:
        cfg = self.config
        body = {"model": cfg.model, "prompt": cfg.prompts[out.prompt_index],
                "max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        out.sent_at = time.time()
        started = time.monotonic()
        headed = False
        try:
            async with asyncio.timeout(cfg.deadline_s):
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    headed = True
                    out.status = resp.status_code
                    if out.behaviour == "abort_early":
                        out.outcome = "aborted"
                        return  # leaving the block closes the connection before any token
                    if resp.status_code >= 400:
                        await resp.aread()
                        out.outcome, out.error = "failed_clean", f"http {resp.status_code}"
                        return
                    chunks = 0
                    async for line in resp.aiter_lines():
                        if out.behaviour == "slow":
                            await asyncio.sleep(cfg.slow_read_s)
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            if out.tokens is not None and out.tokens < cfg.max_tokens:
                                out.outcome = "failed_clean"
                                out.error = f"short stream: {out.tokens} of {cfg.max_tokens}"
                            else:
                                out.outcome = "completed"
                            return
                        event = json.loads(data)
                        if "error" in event:
                            out.outcome, out.error = "failed_clean", str(event["error"])[:300]
                            return
                        usage = event.get("usage")
                        if isinstance(usage, dict):
                            out.tokens = usage.get("completion_tokens")
                        for choice in event.get("choices") or ():
                            if choice.get("text") and out.ttft_s is None:
                                out.ttft_s = time.monotonic() - started
                            out.text += choice.get("text") or ""
                        chunks += 1
                        if out.behaviour == "abort_mid" and chunks >= 3:
                            out.outcome = "aborted"
                            return
                    out.outcome, out.error = "failed_clean", "stream closed without [DONE]"
        except TimeoutError:
            out.outcome = "hung" if headed else "lost"
            out.error = f"no end within {cfg.deadline_s} s"
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError,
                httpx.WriteError) as exc:
            out.outcome, out.error = "failed_clean", f"{type(exc).__name__}: {exc}"[:300]
        except (httpx.HTTPError, ValueError) as exc:
            out.outcome, out.error = "failed_clean", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            out.seconds = time.monotonic() - started


def prompt_pool(count: int, words: int, seed: int) -> list[str]:
    """``count`` distinct prompts of about ``words`` words each."""
    vocab = ["river", "lantern", "copper", "orbit", "violet", "meadow", "signal", "harbor",
             "quiet", "engine", "falcon", "marble", "winter", "garden", "canyon", "ember",
             "silver", "thunder", "willow", "beacon"]
    rng = random.Random(seed)
    return [f"Chaos prompt {i}: " + " ".join(rng.choice(vocab) for _ in range(words))
            for i in range(count)]
