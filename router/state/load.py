"""Router-side load accounting: in-flight requests per worker and recent failures."""

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
        self._failed_at: dict[str, float] = {}
        self._cooldown_s = failure_cooldown_s
        self._clock = clock

    def start(self, worker_id: str) -> None:
        self._in_flight[worker_id] += 1

    def finish(self, worker_id: str) -> None:
        self._in_flight[worker_id] -= 1
        if self._in_flight[worker_id] <= 0:
            del self._in_flight[worker_id]

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
                          recently_failed=self.recently_failed(r.worker_id))
                for r in records]
