"""The load the autoscaler's end-to-end tests put on a cluster (tests/e2e/test_autoscale.py for
``pdserve up --autoscale``, tests/e2e/test_compose.py for Compose's ``--profile autoscale``).

The autoscaler sees one instance through :data:`PROFILE`: a decode instance delivers ~10 output
tokens/s within a 1 s TPOT (9 sequences: 0.02 + 0.1 * 9 = 0.92 s steps), 7.8 at the target
utilisation, so :data:`LOAD_STREAMS` concurrent 96-token streams (over 2.6 tokens/s each) need a
second one, while one 8-token request every 2 s (under 5.9 tokens/s, the safety utilisation of one)
lets the pool shrink back. Few streams: the new worker starts beside them on this machine's two
cores. Re-dispatch's tests (``pdserve up --autoscale`` and Compose's) run one sequence per engine
(``--max-num-seqs 1``) and :data:`QUEUED_LOAD_STREAMS`: one decodes on each engine and the old
decode queues the other three, so when the new one joins at least two still wait there even if a
stream ended meanwhile and its next request went to the new one, and moving the first of them pays:
re-dispatch has a queue to move from (with three streams one waited, and whether moving it paid
depended on that timing). Not more: the load's last answers must end well within the cooldown, or
the first trickle interval reads their length. On a fast engine (the compose containers in a CI run:
130-230 tokens/s observed, a 96-token request per 0.4-0.7 s) new arrivals rebalanced such a queue
before the router's next re-dispatch step (1-3 s after the join); the router now plans a join the
moment it sees it. Prefill capacity is ample. No online fitting and no burst headroom
(:data:`AUTOSCALER_ARGS`): the capacity and the load are what the tests set, whatever the machine's
speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, TypeVar

import httpx

from tests.support.waiting import eventually

PROFILE = {"prefill": {"s_per_token": 1e-6, "overhead_s": 0.001},
           "decode": {"step_base_s": 0.02, "step_per_seq_s": 0.1, "max_seqs": 256}}
LOAD_STREAMS = 3
QUEUED_LOAD_STREAMS = 4
"""The load of the tests that run one sequence per engine (re-dispatch's)."""
COOLDOWN_S = 20
"""Longer than the load's tail: when the load stops, its last answers (96 tokens at one
sequence per engine, up to ~15 s on this 2-core box) run with no new arrival. A 10 s cooldown
let the pool shrink 2 s before the last answer ended (CI, 2026-11-29: no arrival from 02:35:52,
scale-down at 02:36:03, that answer drained over with 74 tokens sent); the trickle's first
interval then read its 96 tokens and grew the pool back during the hold."""
AUTOSCALER_ARGS = ["--interval-s=2", f"--cooldown-s={COOLDOWN_S}", "--tpot-slo-s=1.0",
                   "--ttft-slo-s=30", "--correction-alpha=0", "--burst-quantile=0",
                   "--predictor=last"]
"""``pdserve autoscale`` flags that make it act on :data:`PROFILE` and the load alone."""

T = TypeVar("T")


def streamed_request(url: str, model: str, max_tokens: int) -> bool:
    """One streamed completion through the router at ``url``; True when it ended without an
    error (status or error event)."""
    body = {"model": model, "prompt": "copper lantern " * 20, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                return False
            return not any('"error"' in line for line in resp.iter_lines())
    except httpx.HTTPError:
        return False


@contextmanager
def sustained_load(url: str, model: str, streams: int = LOAD_STREAMS) -> Iterator[list[bool]]:
    """``streams`` streams of 96-token requests, back to back, until the block ends; yields
    every request's outcome (appended as they end)."""
    stop, results = threading.Event(), []

    def stream() -> None:
        while not stop.is_set():
            results.append(streamed_request(url, model, 96))

    with ThreadPoolExecutor(streams) as pool:
        for _ in range(streams):
            pool.submit(stream)
        try:
            yield results
        finally:
            stop.set()


class Trickle(Generic[T]):
    """One 8-token request every 2 s (within one decode worker's capacity), each followed by a
    look at the pool (``pool()``: its size, or its members)."""

    def __init__(self, url: str, model: str, pool: Callable[[], T]) -> None:
        self.url, self.model, self.pool = url, model, pool
        self.results: list[bool] = []
        """Each request's outcome."""

    def step(self) -> T:
        """One request, a 2 s pause, then the pool."""
        self.results.append(streamed_request(self.url, self.model, 8))
        time.sleep(2)
        return self.pool()

    def until(self, want: T, timeout_s: float) -> None:
        """Trickle until the pool is ``want``."""
        eventually(self.step, lambda now: now == want, timeout_s=timeout_s, interval_s=0)

    def hold(self, want: T) -> None:
        """Trickle for a cooldown, the pool ``want`` after every request: the trickle is within
        one worker's capacity, so no interval grows it back or flaps. One cooldown is ten of
        the autoscaler's intervals; the flap this guards against grew the pool back in the
        first interval after the shrink (see :data:`COOLDOWN_S`)."""
        hold_until = time.monotonic() + COOLDOWN_S
        while time.monotonic() < hold_until:
            assert self.step() == want
