"""Per-request phase timeline of the connector, joined across vLLM's processes.

Both connector halves stamp events on the wall clock (``time.time()``: the one clock the
scheduler process, the model-runner process and the router share, and NTP-aligned across
hosts). The stamps travel with :class:`~kvtransfer.stats.TransferStats` to the API server
process, where a :class:`PhaseJoiner` groups them by request and, once a request's chain is
complete, turns consecutive events into phase durations.

Decode chain (a request whose prompt KV is pulled)::

    remote_seen -> pull_started -> read_done -> release_answered -> finished_seen -> first_scheduled
       (scheduler)   (worker)       (worker)      (worker)            (scheduler)      (scheduler)

Prefill chain (a request that leases its blocks to a decode)::

    admitted -> prefill_done -> lease_granted -> lease_released
   (scheduler)   (scheduler)      (worker)         (worker)

A phase is named after the event that ends it (``decode_read`` = pull_started -> read_done).
The phases of one request sum to its first-to-last span exactly. Parameters: ``max_open``
(4096) requests kept waiting for their last event, ``max_age_s`` (900) before an incomplete
request (failed pull, expired lease) is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

DECODE_CHAIN = ("remote_seen", "pull_started", "read_done", "release_answered", "finished_seen",
                "first_scheduled")
PREFILL_CHAIN = ("admitted", "prefill_done", "lease_granted", "lease_released")

_PHASE_NAMES = {
    "pull_started": "decode_wait_pull",
    "read_done": "decode_read",
    "release_answered": "decode_release",
    "finished_seen": "decode_report",
    "first_scheduled": "decode_schedule",
    "prefill_done": "prefill_queue_and_compute",
    "lease_granted": "prefill_grant",
    "lease_released": "prefill_lease_held",
}
PHASES: tuple[str, ...] = tuple(_PHASE_NAMES.values())
"""Every ``phase`` label value of ``pdserve_kv_phase_seconds``."""

Event = tuple[str, str, float]
"""(vLLM request id, event name, wall-clock seconds)."""


@dataclass(frozen=True)
class RequestTimeline:
    """One request's complete chain: its events and the phases between them."""

    request_id: str
    role: str
    events: dict[str, float]
    phases: dict[str, float]

    @property
    def total_s(self) -> float:
        """First event to last event (equals the sum of the phases)."""
        return sum(self.phases.values())


def _chain_for(events: dict[str, float]) -> tuple[str, tuple[str, ...]] | None:
    if "remote_seen" in events or "pull_started" in events:
        return "decode", DECODE_CHAIN
    if "admitted" in events or "lease_granted" in events:
        return "prefill", PREFILL_CHAIN
    return None


class PhaseJoiner:
    """Collects events of many requests and yields each request's timeline when complete."""

    def __init__(self, max_open: int = 4096, max_age_s: float = 900.0) -> None:
        self.max_open = max_open
        self.max_age_s = max_age_s
        self._open: OrderedDict[str, dict[str, float]] = OrderedDict()

    def add(self, events: Iterable[Event]) -> list[RequestTimeline]:
        """Record ``events``; returns the requests whose chain just completed."""
        done: list[RequestTimeline] = []
        newest = 0.0
        for request_id, name, at in events:
            newest = max(newest, at)
            stamps = self._open.setdefault(request_id, {})
            stamps.setdefault(name, at)  # the first stamp of an event wins
            found = _chain_for(stamps)
            if found is None:
                continue
            role, chain = found
            if all(e in stamps for e in chain):
                del self._open[request_id]
                phases = {_PHASE_NAMES[b]: max(0.0, stamps[b] - stamps[a])
                          for a, b in zip(chain, chain[1:], strict=False)}
                done.append(RequestTimeline(request_id, role, stamps, phases))
        self._evict(newest)
        return done

    def _evict(self, now: float) -> None:
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        while self._open:  # oldest first: insertion order is first-event order
            stamps = next(iter(self._open.values()))
            if now - min(stamps.values()) <= self.max_age_s:
                break
            self._open.popitem(last=False)

    def __len__(self) -> int:
        return len(self._open)
