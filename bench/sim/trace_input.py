"""Minimal BurstGPT CSV reader/writer for the simulator (the full reader is ``bench.trace``).

Columns are found by header name, never by position: ``Timestamp, Model, Request tokens,
Response tokens, Total tokens, Log Type`` are required; ``Session ID`` and ``Elapsed time`` are
optional. Failed requests (``Response tokens == 0``) are dropped, as vLLM's harness does.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REQUIRED = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
            "Log Type")
OPTIONAL = ("Session ID", "Elapsed time")


class TraceError(ValueError):
    """The trace file is missing, malformed or empty."""


@dataclass(frozen=True)
class TraceRow:
    """One BurstGPT request record."""

    timestamp_s: float
    model: str
    request_tokens: int
    response_tokens: int
    log_type: str
    session_id: str | None = None

    @property
    def conversation(self) -> bool:
        """A ChatGPT-style conversation turn (vs a one-shot API call)."""
        return self.log_type.lower().startswith("conversation")


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """Rows sorted by timestamp; raises :class:`TraceError` with the reason."""
    path = Path(path)
    try:
        fh = path.open(newline="")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    rows: list[TraceRow] = []
    with fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise TraceError(f"{path} is not a BurstGPT CSV: missing column(s) "
                             f"{', '.join(missing)} (header: {', '.join(header) or 'empty'})")
        has_session = "Session ID" in header
        for line, rec in enumerate(reader, start=2):
            try:
                row = TraceRow(float(rec["Timestamp"]), rec["Model"], int(rec["Request tokens"]),
                               int(float(rec["Response tokens"])), rec["Log Type"],
                               (rec.get("Session ID") or None) if has_session else None)
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{line}: bad value ({exc})") from exc
            if not math.isfinite(row.timestamp_s) or row.request_tokens < 0:
                raise TraceError(f"{path}:{line}: bad timestamp or token count")
            if row.response_tokens <= 0:
                continue
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise TraceError(f"{path} has no successful request rows")
    rows.sort(key=lambda r: r.timestamp_s)
    return rows


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> None:
    """Write rows in BurstGPT's column layout (with ``Session ID``)."""
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([*REQUIRED, "Session ID"])
        for r in rows:
            w.writerow([f"{r.timestamp_s:.3f}", r.model, r.request_tokens, r.response_tokens,
                        r.request_tokens + r.response_tokens, r.log_type, r.session_id or ""])


def synth_rows(n: int, rate_rps: float = 2.0, seed: int = 0, conversation_share: float = 0.8,
               new_session_p: float = 0.25, burstiness: float = 0.5,
               open_sessions: int = 300) -> list[TraceRow]:
    """A BurstGPT-shaped trace: gamma inter-arrivals (shape ``burstiness`` < 1 = bursty),
    log-normal request/response lengths, conversation turns grouped into sessions."""
    return list(iter_synth_rows(n, rate_rps, seed, conversation_share, new_session_p,
                                burstiness, open_sessions))


def iter_synth_rows(n: int, rate_rps: float = 2.0, seed: int = 0,
                    conversation_share: float = 0.8, new_session_p: float = 0.25,
                    burstiness: float = 0.5, open_sessions: int = 300,
                    session_ids: bool = True) -> Iterator[TraceRow]:
    """Lazy :func:`synth_rows`; ``session_ids=False`` leaves sessions to the workload model."""
    rng = random.Random(seed)
    return _synth(rng, n, lambda t: rng.gammavariate(burstiness, 1.0 / (rate_rps * burstiness)),
                  conversation_share, new_session_p, open_sessions, session_ids)


def iter_varying_rows(knots: Sequence[tuple[float, float]], seed: int = 0,
                      burstiness: float = 0.5, conversation_share: float = 0.8,
                      new_session_p: float = 0.25, open_sessions: int = 300,
                      session_ids: bool = True) -> Iterator[TraceRow]:
    """:func:`iter_synth_rows` with an arrival rate that changes over time: ``knots`` are
    ``(time_s, rate_rps)`` points, linearly interpolated; the trace ends at the last knot."""
    if len(knots) < 2 or any(b[0] <= a[0] for a, b in zip(knots, knots[1:], strict=False)):
        raise ValueError("need >= 2 knots with increasing times")
    if any(r <= 0 for _, r in knots):
        raise ValueError("knot rates must be > 0")
    rng = random.Random(seed)
    end = knots[-1][0]

    def rate_at(t: float) -> float:
        i = bisect.bisect_right([k[0] for k in knots], t)
        if i == 0:
            return knots[0][1]
        if i >= len(knots):
            return knots[-1][1]
        (t0, r0), (t1, r1) = knots[i - 1], knots[i]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    def gap(t: float) -> float:
        # the gap is drawn at the rate of its start: fine while the rate changes slowly
        # compared with the mean gap
        return rng.gammavariate(burstiness, 1.0 / (rate_at(t) * burstiness))

    for row in _synth(rng, None, gap, conversation_share, new_session_p, open_sessions,
                      session_ids):
        if row.timestamp_s > end:
            return
        yield row


def _synth(rng: random.Random, n: int | None, gap: Callable[[float], float],
           conversation_share: float, new_session_p: float, open_sessions: int,
           session_ids: bool) -> Iterator[TraceRow]:
    t = 0.0
    sessions: list[str] = []
    next_sid = 0
    for _ in itertools.count() if n is None else range(n):
        t += gap(t)
        req = int(min(max(rng.lognormvariate(5.6, 0.9), 16), 4096))
        resp = int(min(max(rng.lognormvariate(5.0, 0.8), 1), 2048))
        if rng.random() < conversation_share:
            if not sessions or rng.random() < new_session_p:
                sid = f"s{next_sid}"
                next_sid += 1
                sessions.append(sid)
                if len(sessions) > open_sessions:
                    sessions.pop(0)
            else:
                sid = rng.choice(sessions)
            yield TraceRow(t, "ChatGPT", req, resp, "Conversation log",
                           sid if session_ids else None)
        else:
            yield TraceRow(t, "GPT-4", req, resp, "API log", None)


def native_rate(rows: Sequence[TraceRow]) -> float:
    """Mean arrival rate of the trace (requests per second)."""
    span = rows[-1].timestamp_s - rows[0].timestamp_s
    return (len(rows) - 1) / span if span > 0 else float(len(rows))
