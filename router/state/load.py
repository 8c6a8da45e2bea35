"""Router-side load accounting: in-flight requests and uncached prefill tokens per worker, and
recent failures."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from router.policy.base import Candidate
from router.state.registry import WorkerRecord


class LoadTracker:
    """Counts requests dispatched and not yet finished, per worker id; remembers failures."""

    def __init__(self, failure_cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._in_flight: Counter[str] = Counter()
        self._pending_tokens: Counter[str] = Counter()
        self._tokens_of: dict[tuple[str, str], int] = {}  # (worker, request) -> tokens
        self._failed_at: dict[str, float] = {}
        self._cooldown_s = failure_cooldown_s
        self._clock = clock

    def start(self, worker_id: str, request_id: str | None = None, tokens: int = 0) -> None:
        """Count a dispatch; ``tokens`` = its uncached prompt tokens (prefill) until finish."""
        self._in_flight[worker_id] += 1
        if request_id is not None and tokens > 0:
            self._tokens_of[(worker_id, request_id)] = tokens
            self._pending_tokens[worker_id] += tokens

    def finish(self, worker_id: str, request_id: str | None = None) -> None:
        self._in_flight[worker_id] -= 1
        if self._in_flight[worker_id] <= 0:
            del self._in_flight[worker_id]
        if request_id is not None:
            tokens = self._tokens_of.pop((worker_id, request_id), 0)
            if tokens:
                self._pending_tokens[worker_id] -= tokens
                if self._pending_tokens[worker_id] <= 0:
                    del self._pending_tokens[worker_id]

    def pending_tokens(self, worker_id: str) -> int:
        """Uncached prompt tokens dispatched to ``worker_id`` and not finished."""
        return self._pending_tokens[worker_id]

    def in_flight(self, worker_id: str) -> int:
        return self._in_flight[worker_id]

    def mark_failed(self, worker_id: str) -> None:
        self._failed_at[worker_id] = self._clock()

    def mark_ok(self, worker_id: str) -> None:
        self._failed_at.pop(worker_id, None)

    def recently_failed(self, worker_id: str) -> bool:
        at = self._failed_at.get(worker_id)
        return at is not None and self._clock() - at < self._cooldown_s

    def candidates(self, records: Iterable[WorkerRecord]) -> list[Candidate]:
        return [Candidate(worker_id=r.worker_id, in_flight=self._in_flight[r.worker_id],
                          recently_failed=self.recently_failed(r.worker_id),
                          pending_prefill_tokens=self._pending_tokens[r.worker_id],
                          running=self._in_flight[r.worker_id])
                for r in records]
