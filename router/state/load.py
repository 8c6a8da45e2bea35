"""Router-side load accounting: in-flight requests and uncached prefill tokens per worker, and
recent failures; merged with what the workers report into the policies' :class:`Candidate`s."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from router.policy.base import Candidate
from router.state.registry import WorkerRecord
from router.state.worker_load import WorkerLoad

MEAN_TOKENS_ALPHA = 0.05
"""Weight of each new prefill in the running mean of uncached tokens per request."""


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
        self.mean_prefill_tokens = 0.0
        """Running mean of uncached prompt tokens per prefill this router dispatched: the
        estimate for requests a worker holds that someone else sent."""

    def start(self, worker_id: str, request_id: str | None = None, tokens: int = 0,
              *, prefill: bool = False) -> None:
        """Count a dispatch; ``tokens`` = its uncached prompt tokens (prefill) until finish."""
        self._in_flight[worker_id] += 1
        if prefill:
            alpha = MEAN_TOKENS_ALPHA if self.mean_prefill_tokens else 1.0
            self.mean_prefill_tokens += alpha * (tokens - self.mean_prefill_tokens)
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

    def tokens_of(self, worker_id: str, request_id: str) -> int:
        """Uncached prompt tokens ``request_id`` was counted with on ``worker_id`` (0: none)."""
        return self._tokens_of.get((worker_id, request_id), 0)

    def in_flight(self, worker_id: str) -> int:
        return self._in_flight[worker_id]

    def mark_failed(self, worker_id: str) -> None:
        self._failed_at[worker_id] = self._clock()

    def mark_ok(self, worker_id: str) -> None:
        self._failed_at.pop(worker_id, None)

    def recently_failed(self, worker_id: str) -> bool:
        at = self._failed_at.get(worker_id)
        return at is not None and self._clock() - at < self._cooldown_s

    def candidates(self, records: Iterable[WorkerRecord],
                   reported: Mapping[str, WorkerLoad] | None = None) -> list[Candidate]:
        """Snapshots of ``records``: this router's accounting plus each worker's ``reported``
        load (:class:`WorkerLoad`, fresh scrapes only).

        Requests a worker reported beyond this router's in-flight count at that moment were
        sent by someone else (another router replica, a direct client); they count as running
        sequences and, on prefill workers, as queued uncached tokens at this router's mean.
        """
        reported = reported or {}
        out = []
        for r in records:
            wid = r.worker_id
            own = self._in_flight[wid]
            pending = self._pending_tokens[wid]
            kv_usage = 0.0
            foreign = 0
            load = reported.get(wid)
            if load is not None:
                foreign = max(load.running + load.waiting - load.own_in_flight, 0)
                kv_usage = load.kv_usage
                if r.role in ("prefill", "aggregated", "flex"):
                    pending += round(foreign * self.mean_prefill_tokens)
            out.append(Candidate(worker_id=wid, in_flight=own,
                                 recently_failed=self.recently_failed(wid),
                                 pending_prefill_tokens=pending, running=own + foreign,
                                 kv_usage=kv_usage))
        return out
