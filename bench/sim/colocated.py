"""One simulated engine that prefills and decodes in the same iterations (vLLM's colocation).

Each iteration decodes one token of every running sequence and carries up to ``chunk_tokens``
of queued prefill (FIFO; a long prompt spans iterations). It lasts
``costs.step_s(running)`` (when anything decodes) + the chunk's prefill (when it carries
prefill: ``prefill_fixed_s`` once and each part's ``costs.compute_s`` after the context that
part attends to): the path cost model's own terms (:class:`router.policy.path_cost.PathCosts`), so a
prefill on an engine stalls every sequence it decodes. An engine that only decodes runs its
iterations as one segment up to the earliest finish; new work (a prompt to prefill, a sequence
to join) cuts the segment at the end of the step in progress. Sequences join at iteration
boundaries only.

The engine holds no clock and no event queue: the fleet (:mod:`bench.sim.fleet`) calls
``wake(now)`` after handing it work, schedules the end time it returns, and calls
``complete(now)`` when that time comes (an end time superseded by a later ``wake`` carries an
older ``version`` and is dropped).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Generic, TypeVar

from router.policy.cache_model import PrefixCacheModel
from router.policy.path_cost import PathCosts

T = TypeVar("T")


class _Prefill(Generic[T]):
    __slots__ = ("item", "left", "done")

    def __init__(self, item: T, left: int, done: int) -> None:
        self.item = item
        self.left = left
        self.done = done
        """Tokens of the sequence before the next chunk: its cached prefix and the chunks
        computed so far (what the next chunk attends to)."""


class ColocatedEngine(Generic[T]):
    """A FIFO of prompts to prefill, a batch of decoding sequences, one iteration at a time;
    ``T`` is the caller's job type (returned as it was given)."""

    def __init__(self, wid: str, role: str, costs: PathCosts, chunk_tokens: int,
                 cache_blocks: int) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.wid = wid
        self.role = role
        self.costs = costs
        self.chunk_tokens = chunk_tokens
        self.cache = PrefixCacheModel(cache_blocks)
        """The engine's true prefix cache (filled by prefills and pulls)."""
        self.version = 0
        self.in_flight = 0
        """Requests the fleet placed here and not yet finished (either part)."""
        self.prefill_busy_s = 0.0
        self.busy_s = 0.0
        self._queue: deque[_Prefill[T]] = deque()
        self._joining: list[tuple[int, T]] = []
        self._decoding: list[tuple[int, int, T]] = []  # (finish at token count, seq, job)
        self._seq = 0
        self._tokens = 0  # decode iterations done; a sequence finishes at its target count
        self._active = False
        self._start_s = 0.0
        self._step_s = 0.0
        self._steps = 0
        self._chunk: list[tuple[_Prefill[T], int]] = []

    @property
    def running(self) -> int:
        """Sequences decoding or about to join the batch."""
        return len(self._decoding) + len(self._joining)

    def add_prefill(self, item: T, uncached_tokens: int, context_tokens: int = 0) -> None:
        """Queue ``uncached_tokens`` of prefill for ``item`` (0: only its first token's step)
        after ``context_tokens`` it has cached (they cost attention, not compute)."""
        left = max(uncached_tokens, 1)
        self._queue.append(_Prefill(item, left, max(context_tokens - (left - uncached_tokens),
                                                      0)))

    def add_decode(self, item: T, tokens: int) -> None:
        """``item`` decodes ``tokens`` (>= 1) more tokens here from the next boundary on."""
        self._joining.append((tokens, item))

    def wake(self, now: float) -> float | None:
        """Start the next iteration when idle, or cut a decode segment for new work; the end
        time to schedule (None: nothing new to schedule)."""
        if self._active:
            if self._chunk or not (self._queue or self._joining):
                return None
            done = min(self._steps, math.floor((now - self._start_s) / self._step_s) + 1)
            if done >= self._steps:
                return None
            self._steps = done
            self.version += 1
            return self._start_s + done * self._step_s
        self._merge()
        n = len(self._decoding)
        if self._queue:
            budget, chunk = self.chunk_tokens, []
            for work in self._queue:
                take = min(work.left, budget)
                chunk.append((work, take))
                budget -= take
                if budget == 0:
                    break
            costs = self.costs
            prefill = costs.prefill_s(sum(t for _, t in chunk)) \
                if not costs.prefill_s_per_token_sq else costs.prefill_fixed_s + sum(
                    costs.compute_s(take, work.done) for work, take in chunk)
            self._chunk, self._steps = chunk, 1 if n else 0
            self._step_s = self.costs.step_s(n) if n else 0.0
            duration = prefill + self._step_s
            self.prefill_busy_s += prefill
        elif n:
            self._chunk, self._step_s = [], self.costs.step_s(n)
            self._steps = self._decoding[0][0] - self._tokens
            duration = self._steps * self._step_s
        else:
            return None
        self._active, self._start_s = True, now
        self.version += 1
        return now + duration

    def complete(self, now: float) -> tuple[list[T], list[T]]:
        """The iteration or segment ending at ``now`` is done: (items whose prefill finished,
        items that decoded their last token)."""
        self.busy_s += now - self._start_s
        self._active = False
        self._tokens += self._steps
        prefilled = []
        for work, take in self._chunk:
            work.left -= take
            work.done += take
            if work.left == 0:
                self._queue.popleft()
                prefilled.append(work.item)
        self._chunk = []
        finished = []
        while self._decoding and self._decoding[0][0] <= self._tokens:
            finished.append(heapq.heappop(self._decoding)[2])
        return prefilled, finished

    def _merge(self) -> None:
        for tokens, item in self._joining:
            self._seq += 1
            heapq.heappush(self._decoding, (self._tokens + tokens, self._seq, item))
        self._joining.clear()
