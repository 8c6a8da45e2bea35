"""Leases on a prefill worker's finished blocks (pure state; time is an argument).

A lease starts when the scheduler hands a finished prefill's blocks to the connector and ends
when a decode worker releases it after its pull, or when it expires. The answer to a release
tells the decode whether its read is valid: "ok" means the blocks were still held when the
release arrived, and since a decode releases only after every read completed, nothing it read
can have been overwritten. "expired" means the lease had ended first and the read must be
discarded (vLLM then recomputes).

Leases are one-shot and bound to a secret. Each carries a random token (in the router-signed
``kv_transfer_params``); a release or renewal must echo it, or it is refused and the lease is
left alone. The first matching release ends the lease; any later release of the same id is
answered "expired": its blocks may already hold another request's KV. A lease lives at most
``life_factor`` times its first length, however often it is renewed.

While the decode's scheduler still queues the request (overload: no KV blocks or run slots
free), it renews the lease every third of its length, so a slow decode does not turn into a
recompute storm; a decode that gives up releases at once.

A release may arrive before the grant (the scheduler tells the worker about new leases one
engine step after the request finished). The blocks cannot have been freed before the grant,
so such an early release is answered "ok" once per (id, token) and finishes the lease when
it is granted with that token.

Every release and renewal is answered with a ``LeaseAnswer``: whether the decode's read is
valid (``ok``) and whether the requester proved it holds a lease this engine granted
(``vouched``: its token matched a lease, held or already ended). Only a vouched requester may
make the prefill's transport connect to it to send the answer (security review finding 15);
an early release proves nothing, since anyone can make one up.

Parameters: ``memory_s`` (default 600) is how long released, expired and early-released ids
are remembered, bounding state while keeping late answers truthful (longer than the router's
signature lifetime, so no validly signed params outlive the memory of their lease);
``max_early`` (65,536) bounds the early releases kept (anyone on the control channel can make
them up; the oldest is forgotten first).
"""

from __future__ import annotations

import collections
import enum
import hmac
import threading
from dataclasses import dataclass


class LeaseAnswer(enum.Enum):
    """The outcome of a release or a renewal (``ok``: answer "ok"; ``vouched``: the requester
    holds a lease's token)."""

    HELD = "held"
    """The lease was active and the token is its own: released (the read is valid), or
    renewed."""
    EARLY = "early"
    """A release of an id not granted yet: remembered, answered ok, proves nothing."""
    ENDED = "ended"
    """The token is the lease's own, but the lease had already ended (expired or released)."""
    REFUSED = "refused"
    """Another token, an id never granted (renewal) or a repeated early release."""

    @property
    def ok(self) -> bool:
        """Answer "ok": a release's read is valid, a renewal held the lease."""
        return self in (LeaseAnswer.HELD, LeaseAnswer.EARLY)

    @property
    def vouched(self) -> bool:
        """The requester echoed the token of a lease this table granted."""
        return self in (LeaseAnswer.HELD, LeaseAnswer.ENDED)

    def __bool__(self) -> bool:
        # every Enum member is truthy: `if table.release(...)` would accept every release
        raise TypeError("use LeaseAnswer.ok or LeaseAnswer.vouched")


@dataclass
class _Lease:
    expires_at: float
    hard_deadline: float
    token: str


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class LeaseTable:
    """Thread-safe lease bookkeeping shared by the release responder and ``get_finished``."""

    def __init__(self, memory_s: float = 600.0, life_factor: float = 4.0,
                 max_early: int = 65536) -> None:
        self._memory_s = memory_s
        self._life_factor = life_factor
        self._max_early = max_early
        self._lock = threading.Lock()
        self._active: dict[str, _Lease] = {}
        self._ended: dict[str, tuple[float, str]] = {}  # released or expired id -> when, token
        self._early: dict[tuple[str, str], float] = {}  # (id, token) released before granted
        self._finished: set[str] = set()                # blocks may be freed now
        # (id, wall clock) of "ok" releases; bounded as the early ones (made-up ids are "ok")
        self._released: collections.deque[tuple[str, float]] = collections.deque(
            maxlen=max_early)
        # (id, token) of early releases their grant just vouched for (take_granted_early)
        self._granted_early: collections.deque[tuple[str, str]] = collections.deque(
            maxlen=max_early)
        self.num_released = 0
        self.num_expired = 0
        self.num_renewed = 0
        self.num_refused = 0
        """Releases and renewals refused: wrong token, or a lease already ended (a repeat)."""

    def grant(self, request_id: str, expires_at: float, token: str, now: float) -> None:
        """Start holding ``request_id``'s blocks until ``expires_at`` (``now`` is the grant
        time: the lease never outlives ``now + life_factor * (expires_at - now)``)."""
        with self._lock:
            if self._early.pop((request_id, token), None) is not None:
                self._granted_early.append((request_id, token))
                self._finished.add(request_id)
                self._ended[request_id] = (now, token)
                self.num_released += 1
                return
            life = max(expires_at - now, 0.0) * self._life_factor
            self._active[request_id] = _Lease(expires_at, now + life, token)

    def release(self, request_id: str, token: str, now: float,
                wall_s: float = 0.0) -> LeaseAnswer:
        """A decode finished reading; ``ok`` when its read is valid (the lease was held and the
        token is its own: HELD, or EARLY before the grant). Every later release of the id is
        ENDED (its own token) or REFUSED. An ``ok`` release is kept with ``wall_s`` (its
        wall-clock time) for :meth:`take_released`, in the same critical section that lets
        :meth:`take_finished` free the blocks, so the stamp is there before the blocks go."""
        with self._lock:
            lease = self._active.get(request_id)
            if lease is not None:
                if not _same(lease.token, token):
                    self.num_refused += 1
                    return LeaseAnswer.REFUSED
                del self._active[request_id]
                self._ended[request_id] = (now, token)
                self._finished.add(request_id)
                self._released.append((request_id, wall_s))
                self.num_released += 1
                return LeaseAnswer.HELD
            ended = self._ended.get(request_id)
            if ended is not None:
                self.num_refused += 1
                return LeaseAnswer.ENDED if _same(ended[1], token) else LeaseAnswer.REFUSED
            if (request_id, token) in self._early:
                self.num_refused += 1
                return LeaseAnswer.REFUSED
            if len(self._early) >= self._max_early:  # a flood of made-up ids: oldest go first
                del self._early[next(iter(self._early))]
            self._early[(request_id, token)] = now
            self._released.append((request_id, wall_s))
            return LeaseAnswer.EARLY

    def renew(self, request_id: str, token: str, expires_at: float) -> LeaseAnswer:
        """A decode still queues ``request_id``: hold its blocks until ``expires_at`` (never
        shortened, never past the lease's life cap): HELD. Otherwise (the lease is gone: ENDED
        with its own token; another token or an unknown id: REFUSED) a read would fail."""
        with self._lock:
            lease = self._active.get(request_id)
            if lease is None or not _same(lease.token, token):
                self.num_refused += 1
                ended = self._ended.get(request_id)
                if lease is None and ended is not None and _same(ended[1], token):
                    return LeaseAnswer.ENDED
                return LeaseAnswer.REFUSED
            lease.expires_at = min(max(lease.expires_at, expires_at), lease.hard_deadline)
            self.num_renewed += 1
            return LeaseAnswer.HELD

    def expire(self, now: float) -> list[str]:
        """End every lease past its expiry; returns their ids (their blocks become free)."""
        with self._lock:
            gone = [rid for rid, lease in self._active.items() if lease.expires_at <= now]
            for rid in gone:
                self._ended[rid] = (now, self._active.pop(rid).token)
                self._finished.add(rid)
            self.num_expired += len(gone)
            horizon = now - self._memory_s
            for rid in [r for r, (t, _) in self._ended.items() if t < horizon]:
                del self._ended[rid]
            for key in [k for k, t in self._early.items() if t < horizon]:
                del self._early[key]
            return gone

    def take_finished(self) -> set[str]:
        """Ids whose blocks may be freed now (released or expired); clears the set."""
        with self._lock:
            done, self._finished = self._finished, set()
            return done

    def take_granted_early(self) -> list[tuple[str, str]]:
        """(id, token) of the early releases granted since the last call: the grant carried
        their token, so the release is now vouched for (its answer may go out)."""
        with self._lock:
            done = list(self._granted_early)
            self._granted_early.clear()
            return done

    def take_released(self) -> list[tuple[str, float]]:
        """(id, wall clock) of every release answered "ok" since the last call, in order."""
        with self._lock:
            done = list(self._released)
            self._released.clear()
            return done

    @property
    def num_active(self) -> int:
        """Leases currently holding blocks."""
        with self._lock:
            return len(self._active)
