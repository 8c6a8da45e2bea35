"""Leases on a prefill worker's finished blocks (pure state; time is an argument).

A lease starts when the scheduler hands a finished prefill's blocks to the connector and ends
when a decode worker releases it after its pull, or when it expires. The answer to a release
tells the decode whether its read is valid: ``True`` means the blocks were still held when the
release arrived, and since a decode releases only after every read completed, nothing it read
can have been overwritten. ``False`` means the lease had expired first and the read must be
discarded (vLLM then recomputes).

While the decode's scheduler still queues the request (overload: no KV blocks or run slots
free), it renews the lease every third of its length, so a slow decode does not turn into a
recompute storm; a decode that gives up releases at once.

A release may arrive before the grant (the scheduler tells the worker about new leases one
engine step after the request finished). The blocks cannot have been freed before the grant,
so such an early release is answered ``True`` and finishes the lease as soon as it is granted.

Parameters: ``memory_s`` (default 600) is how long expired and early-released ids are
remembered, bounding state while keeping late answers truthful.
"""

from __future__ import annotations

import threading


class LeaseTable:
    """Thread-safe lease bookkeeping shared by the release responder and ``get_finished``."""

    def __init__(self, memory_s: float = 600.0) -> None:
        self._memory_s = memory_s
        self._lock = threading.Lock()
        self._active: dict[str, float] = {}      # request id -> expiry time
        self._expired: dict[str, float] = {}     # request id -> when it expired
        self._early: dict[str, float] = {}       # released before granted -> release time
        self._finished: set[str] = set()         # blocks may be freed now
        self.num_released = 0
        self.num_expired = 0
        self.num_renewed = 0

    def grant(self, request_id: str, expires_at: float) -> None:
        """Start holding ``request_id``'s blocks until ``expires_at``."""
        with self._lock:
            if self._early.pop(request_id, None) is not None:
                self._finished.add(request_id)
                self.num_released += 1
                return
            self._active[request_id] = expires_at

    def release(self, request_id: str, now: float) -> bool:
        """A decode finished reading; True when its read is valid (blocks were still held)."""
        with self._lock:
            if request_id in self._active:
                del self._active[request_id]
                self._finished.add(request_id)
                self.num_released += 1
                return True
            if request_id in self._expired:
                return False
            self._early.setdefault(request_id, now)
            return True

    def renew(self, request_id: str, expires_at: float) -> bool:
        """A decode still queues ``request_id``: hold its blocks until ``expires_at`` (never
        shortened). False when the lease is gone (expired or released): its read would fail."""
        with self._lock:
            if request_id in self._active:
                self._active[request_id] = max(self._active[request_id], expires_at)
                self.num_renewed += 1
                return True
            return False

    def expire(self, now: float) -> list[str]:
        """End every lease past its expiry; returns their ids (their blocks become free)."""
        with self._lock:
            gone = [rid for rid, deadline in self._active.items() if deadline <= now]
            for rid in gone:
                del self._active[rid]
                self._expired[rid] = now
                self._finished.add(rid)
            self.num_expired += len(gone)
            horizon = now - self._memory_s
            for table in (self._expired, self._early):
                for rid in [r for r, t in table.items() if t < horizon]:
                    del table[rid]
            return gone

    def take_finished(self) -> set[str]:
        """Ids whose blocks may be freed now (released or expired); clears the set."""
        with self._lock:
            done, self._finished = self._finished, set()
            return done

    @property
    def num_active(self) -> int:
        """Leases currently holding blocks."""
        with self._lock:
            return len(self._active)
