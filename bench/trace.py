"""Streaming reader for BurstGPT traces and the replay schedule built from them.

BurstGPT CSVs are parsed by column name, so both layouts work: the 6-column v1 files
(``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``) and the newer
files that add ``Session ID`` and ``Elapsed time`` anywhere in the header. Rows are read
one at a time; only kept rows are held, so multi-million-row files stream.

Parameters (defaults):
  models=None (all)          keep rows whose ``Model`` is one of these
  log_types=None (all)       keep rows whose ``Log Type`` is one of these
  start_s=0.0                window start, trace seconds after the first row's timestamp
  duration_s=None (to end)   window length in trace seconds
  max_requests=None          stop after this many kept rows
  time_scale=None            replay X times faster (arrival gaps divided by X)
  rate=None                  rescale time so the mean rate is R req/s (burst shape kept)

Dropped rows are counted per reason in :class:`TraceStats` (``zero_request_tokens``,
``failed`` = ``Response tokens == 0``, ``model``, ``log_type``, ``before_window``).
"""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

COL_TIMESTAMP = "Timestamp"
COL_MODEL = "Model"
COL_REQUEST = "Request tokens"
COL_RESPONSE = "Response tokens"
COL_TOTAL = "Total tokens"
COL_LOG_TYPE = "Log Type"
COL_SESSION = "Session ID"
COL_ELAPSED = "Elapsed time"

REQUIRED_COLUMNS = (COL_TIMESTAMP, COL_MODEL, COL_REQUEST, COL_RESPONSE, COL_LOG_TYPE)
V1_COLUMNS = (COL_TIMESTAMP, COL_MODEL, COL_REQUEST, COL_RESPONSE, COL_TOTAL, COL_LOG_TYPE)
V2_COLUMNS = (COL_TIMESTAMP, COL_SESSION, COL_MODEL, COL_REQUEST, COL_RESPONSE, COL_TOTAL,
              COL_LOG_TYPE, COL_ELAPSED)


class TraceError(ValueError):
    """A trace file that cannot be read; ``line`` is the 1-based line number (0: whole file)."""

    def __init__(self, message: str, line: int = 0, source: str = "") -> None:
        where = f"{source}:{line}: " if line else (f"{source}: " if source else "")
        super().__init__(where + message)
        self.line = line
        self.source = source


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One BurstGPT request record."""

    timestamp_s: float
    model: str
    request_tokens: int
    response_tokens: int
    total_tokens: int
    log_type: str
    session_id: str | None = None
    elapsed_s: float | None = None
    line: int = 0
    """Line number in the source file (header is line 1)."""


@dataclass
class TraceStats:
    """What the reader saw: rows read, kept, and dropped per reason."""

    source: str = ""
    layout: str = ""
    rows_read: int = 0
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    first_timestamp_s: float | None = None
    last_kept_timestamp_s: float | None = None

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "layout": self.layout, "rows_read": self.rows_read,
                "rows_kept": self.rows_kept, "dropped": dict(sorted(self.dropped.items())),
                "first_timestamp_s": self.first_timestamp_s,
                "last_kept_timestamp_s": self.last_kept_timestamp_s}


def _parse_int(text: str, column: str, line: int, source: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"column {column!r}: {text!r} is not a number", line, source) from None
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise TraceError(f"column {column!r}: {text!r} is not a non-negative integer",
                         line, source)
    return int(value)


def _parse_float(text: str, column: str, line: int, source: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"column {column!r}: {text!r} is not a number", line, source) from None
    if not math.isfinite(value):
        raise TraceError(f"column {column!r}: {text!r} is not finite", line, source)
    return value


def _open(source: str | Path | IO[str]) -> tuple[IO[str], str, bool]:
    if isinstance(source, str | Path):
        return open(source, newline="", encoding="utf-8"), str(source), True  # noqa: SIM115
    return source, getattr(source, "name", "<stream>"), False


def read_trace(source: str | Path | IO[str], *, models: Iterable[str] | None = None,
               log_types: Iterable[str] | None = None, start_s: float = 0.0,
               duration_s: float | None = None, max_requests: int | None = None,
               stats: TraceStats | None = None) -> Iterator[TraceRow]:
    """Yield kept rows of a BurstGPT CSV one at a time, in file order.

    Stops reading as soon as the window or ``max_requests`` is exhausted. Raises
    :class:`TraceError` naming the line for a malformed row or decreasing timestamps.
    """
    stats = stats if stats is not None else TraceStats()
    model_set = {m.strip().lower() for m in models} if models else None
    log_set = {t.strip().lower() for t in log_types} if log_types else None
    fh, name, owned = _open(source)
    stats.source = name
    try:
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError("empty file: no header", 0, name) from None
        cols = {h.strip().lower(): i for i, h in enumerate(header)}
        missing = [c for c in REQUIRED_COLUMNS if c.lower() not in cols]
        if missing:
            raise TraceError(f"header lacks column(s) {missing}; got {header}", 1, name)
        i_ts, i_model = cols[COL_TIMESTAMP.lower()], cols[COL_MODEL.lower()]
        i_req, i_resp = cols[COL_REQUEST.lower()], cols[COL_RESPONSE.lower()]
        i_log = cols[COL_LOG_TYPE.lower()]
        i_total = cols.get(COL_TOTAL.lower())
        i_sess = cols.get(COL_SESSION.lower())
        i_elapsed = cols.get(COL_ELAPSED.lower())
        stats.layout = f"{len(header)}-column" + (" with sessions" if i_sess is not None else "")
        width = len(header)
        prev_ts = -math.inf
        window_start = window_end = None
        kept = 0
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != width:
                raise TraceError(f"expected {width} fields, got {len(row)}: {row}", line, name)
            stats.rows_read += 1
            ts = _parse_float(row[i_ts], COL_TIMESTAMP, line, name)
            if ts < prev_ts:
                raise TraceError(f"timestamp {ts} is before the previous row's {prev_ts}; "
                                 "traces must be sorted by time", line, name)
            prev_ts = ts
            req = _parse_int(row[i_req], COL_REQUEST, line, name)
            resp = _parse_int(row[i_resp], COL_RESPONSE, line, name)
            total = (_parse_int(row[i_total], COL_TOTAL, line, name)
                     if i_total is not None and row[i_total].strip() else req + resp)
            if window_start is None:
                stats.first_timestamp_s = ts
                window_start = ts + start_s
                window_end = window_start + duration_s if duration_s is not None else math.inf
            if ts < window_start:
                stats.drop("before_window")
                continue
            assert window_end is not None
            if ts >= window_end:
                break
            if resp == 0:
                stats.drop("failed")
                continue
            if req == 0:
                stats.drop("zero_request_tokens")
                continue
            model, log_type = row[i_model].strip(), row[i_log].strip()
            if model_set is not None and model.lower() not in model_set:
                stats.drop("model")
                continue
            if log_set is not None and log_type.lower() not in log_set:
                stats.drop("log_type")
                continue
            session = (row[i_sess].strip() or None) if i_sess is not None else None
            elapsed = (_parse_float(row[i_elapsed], COL_ELAPSED, line, name)
                       if i_elapsed is not None and row[i_elapsed].strip() else None)
            stats.rows_kept += 1
            stats.last_kept_timestamp_s = ts
            yield TraceRow(ts, model, req, resp, total, log_type, session, elapsed, line)
            kept += 1
            if max_requests is not None and kept >= max_requests:
                break
    except csv.Error as exc:
        raise TraceError(f"CSV syntax error: {exc}", reader.line_num, name) from exc
    finally:
        if owned:
            fh.close()


def write_trace(rows: Iterable[TraceRow], out: str | Path | IO[str], *,
                layout: str = "v1") -> int:
    """Write rows as a BurstGPT CSV (``v1``: 6 columns, ``v2``: with Session ID/Elapsed time)."""
    if layout not in ("v1", "v2"):
        raise ValueError(f"layout must be 'v1' or 'v2', got {layout!r}")
    fh, _, owned = (open(out, "w", newline="", encoding="utf-8"), "", True) \
        if isinstance(out, str | Path) else (out, "", False)  # noqa: SIM115
    try:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(V1_COLUMNS if layout == "v1" else V2_COLUMNS)
        n = 0
        for r in rows:
            ts = _fmt_num(r.timestamp_s)
            if layout == "v1":
                writer.writerow([ts, r.model, r.request_tokens, r.response_tokens,
                                 r.total_tokens, r.log_type])
            else:
                writer.writerow([ts, r.session_id or "", r.model, r.request_tokens,
                                 r.response_tokens, r.total_tokens, r.log_type,
                                 "" if r.elapsed_s is None else _fmt_num(r.elapsed_s)])
            n += 1
        return n
    finally:
        if owned:
            fh.close()


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6f}".rstrip("0")


def trace_to_text(rows: Iterable[TraceRow], layout: str = "v1") -> str:
    """The CSV text of ``rows`` (for tests and small fixtures)."""
    buf = io.StringIO()
    write_trace(rows, buf, layout=layout)
    return buf.getvalue()


@dataclass(frozen=True)
class ScheduledRow:
    """A trace row with its replay offset (seconds after the run starts)."""

    at_s: float
    row: TraceRow


def schedule(rows: list[TraceRow], *, time_scale: float | None = None, rate: float | None = None,
             duration_s: float | None = None) -> tuple[list[ScheduledRow], float]:
    """Replay offsets for ``rows``; returns them and the effective time scale.

    ``time_scale`` X divides every gap by X. ``rate`` R picks X so the mean arrival rate
    becomes R (the trace's rate is rows / window length, the window being ``duration_s`` when
    given, else the span of the rows). Gap ratios, hence burstiness, are kept either way.
    """
    if time_scale is not None and rate is not None:
        raise ValueError("give time_scale or rate, not both")
    if time_scale is not None and time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not rows:
        return [], 1.0
    t0 = rows[0].timestamp_s
    scale = 1.0 if time_scale is None else time_scale
    if rate is not None:
        span = duration_s if duration_s else rows[-1].timestamp_s - t0
        if len(rows) == 1 or span <= 0:
            scale = 1.0
        else:
            n = len(rows) if duration_s else len(rows) - 1
            scale = rate / (n / span)
    return [ScheduledRow((r.timestamp_s - t0) / scale, r) for r in rows], scale


def per_second_counts(offsets: Iterable[float], bin_s: float = 1.0) -> list[int]:
    """Arrivals per ``bin_s`` bin (for burstiness checks and the arrival-rate plot)."""
    counts: list[int] = []
    for t in offsets:
        b = int(t // bin_s)
        if b >= len(counts):
            counts.extend([0] * (b + 1 - len(counts)))
        counts[b] += 1
    return counts
