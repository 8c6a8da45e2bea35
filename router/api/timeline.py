"""The router's phase timeline of one request.

Events, in order (a request that fails early stops at the last one it reached)::

    received -> validated -> prefill_chosen -> prefill_answered -> decode_chosen
             -> decode_first_byte -> done

A phase is named after the event that ends it, so the phases of one request sum exactly to
its end-to-end time (``received`` -> ``done``). Each event is stamped on the monotonic clock
(durations) and on the wall clock (to line the router up with the workers' connector
timelines, which use ``time.time()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.api.context import upstream_request_id

EVENTS = ("received", "validated", "prefill_chosen", "prefill_answered", "decode_chosen",
          "decode_first_byte", "done")
PHASES = {
    "validated": "validate",
    "prefill_chosen": "prefill_choose",
    "prefill_answered": "prefill",
    "decode_chosen": "decode_choose",
    "decode_first_byte": "decode_first_byte",
    "done": "stream",
}
"""Ending event -> ``phase`` label of ``pdserve_router_phase_seconds``."""


@dataclass
class PhaseClock:
    """Event stamps of one request; ``mark`` keeps the first stamp of each event."""

    request_id: str
    """The client's id (echoed; see ``router.api.context``)."""
    upstream_id: str = ""
    """The router's unique id of this request: its ledgers' key and the workers' request id."""
    mono: dict[str, float] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    path: str = ""
    """The path the request took (``pdserve_router_paths_total``'s label), once decided."""
    first_output: float | None = None
    """``perf_counter`` when a stream's first generated token reached the client (None: not a
    stream, or nothing generated)."""
    tpot_s: float | None = None
    """A stream's mean gap between generated tokens, once it ended."""
    plan: dict[str, object] = field(default_factory=dict)
    """The adaptive decision: path, reason, workers and predicted TTFT/TPOT (empty when the
    fleet's roles chose the path)."""
    moves: list[dict[str, object]] = field(default_factory=list)
    """Every move of the stream to another worker: from, to, why, when (wall clock) and how
    many generated tokens the client had then."""
    span: object | None = None
    """The request's trace span while tracing is on (see ``router.api.tracing``)."""
    output_tokens: int | None = None
    """Tokens the answer generated, as the worker's ``usage`` counted them (None: no usage
    was seen)."""
    output_events: int = 0
    """Events with generated output a stream relayed (a lower bound of its tokens)."""
    model: str = ""
    """The served model, once known to be one a live worker registered (the ``model_name``
    label of the router's request metrics; ``""`` for requests refused before that)."""
    on_prefilled: Callable[[], None] | None = None
    """Called once, when the request's prompt is known to be prefilled: the prefill's answer
    (``prefill_answered``) or, served whole, its stream's first generated token."""

    @classmethod
    def start(cls, request_id: str, at: float | None = None) -> PhaseClock:
        """A clock whose ``received`` event is now (or ``at``, a ``perf_counter`` value)."""
        clock = cls(request_id, upstream_request_id(request_id))
        now = time.perf_counter()
        clock.mono["received"] = now if at is None else at
        clock.wall["received"] = time.time() - (now - clock.mono["received"])
        return clock

    def mark(self, event: str) -> None:
        """Stamp ``event`` now, unless it was stamped already (a retry keeps the first)."""
        if event not in EVENTS:
            raise ValueError(f"unknown timeline event {event!r}")
        if event not in self.mono:
            self.mono[event] = time.perf_counter()
            self.wall[event] = time.time()
            if event == "prefill_answered":
                self._prefilled()

    def saw_first_output(self, at: float) -> None:
        """The stream's first generated token reached the client at ``at`` (``perf_counter``;
        kept only the first time)."""
        if self.first_output is None:
            self.first_output = at
            self._prefilled()

    def _prefilled(self) -> None:
        hook, self.on_prefilled = self.on_prefilled, None
        if hook is not None:
            hook()

    @property
    def started(self) -> float:
        """``perf_counter`` value of ``received``."""
        return self.mono["received"]

    def phases(self) -> dict[str, float]:
        """Duration of each phase reached, in event order (sums to received -> last event)."""
        out: dict[str, float] = {}
        previous = self.mono["received"]
        for event in EVENTS[1:]:
            if event in self.mono:
                out[PHASES[event]] = max(0.0, self.mono[event] - previous)
                previous = max(previous, self.mono[event])
        return out

    def record(self) -> dict[str, object]:
        """The JSON line of the timeline file."""
        return {"source": "router", "request_id": self.request_id,
                "upstream_id": self.upstream_id, "path": self.path,
                **({"plan": dict(self.plan)} if self.plan else {}),
                **({"moves": list(self.moves)} if self.moves else {}),
                "events": dict(self.wall), "phases": self.phases()}
