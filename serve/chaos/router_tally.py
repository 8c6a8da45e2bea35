"""What the chaos cluster's router did about the faults: streams it moved to another worker and
requests it served on another role's engine, summed across router restarts.

The router's counters start again at 0 when it restarts (the ``router_restart`` fault), so the
runner reads its ``/metrics`` every second and :class:`CounterTally` adds up the increments (a
read in which a count went down was made after a restart: its values count from 0). Increments
between the last read before a restart and the restart itself are missed. Pure: the caller does
the reading.
"""

from __future__ import annotations

from collections import defaultdict

from router.samples import Samples

MOVES = "pdserve_router_migrations_total"
REFUSED = "pdserve_router_migrations_refused_total"
PATHS = "pdserve_router_paths_total"
FALLBACK_REASONS = frozenset({"no_prefill_worker", "no_decode_worker", "prefill_failed"})
"""``pdserve_router_paths_total`` reasons that mean a role's pool could not serve its part."""


class CounterTally:
    """Running totals of the router's fault counters over reads that may span restarts."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self._totals: dict[tuple[str, frozenset[tuple[str, str]]], float] = defaultdict(float)

    def add(self, samples: Samples) -> None:
        """Take one read of the router's samples; a read in which any count went down was made
        after a restart, so each of its values counts from 0."""
        read = {k: v for k, v in samples.items() if k[0] in (MOVES, REFUSED, PATHS)}
        restarted = any(v < self._last.get(k, 0.0) for k, v in read.items())
        for key, value in read.items():
            self._totals[key] += value if restarted else value - self._last.get(key, 0.0)
        self._last = read

    def _by(self, name: str, label: str) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (sample, labels), value in self._totals.items():
            if sample == name and value:
                out[dict(labels).get(label, "")] += int(value)
        return dict(sorted(out.items()))

    def summary(self) -> dict[str, dict[str, int]]:
        """Moves by reason, refused moves by reason, and fallbacks by ``path/reason``."""
        fallbacks: dict[str, int] = defaultdict(int)
        for (sample, labels), value in self._totals.items():
            found = dict(labels)
            if sample == PATHS and found.get("reason") in FALLBACK_REASONS and value:
                fallbacks[f"{found.get('path')}/{found.get('reason')}"] += int(value)
        return {"moves": self._by(MOVES, "reason"), "moves_refused": self._by(REFUSED, "reason"),
                "fallbacks": dict(sorted(fallbacks.items()))}
