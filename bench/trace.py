"""The BurstGPT trace reader (the one the load harness and the simulator both use), the
writer, and the replay schedule built from a trace.

Rules, and why:
- Columns are found by header name, never by position, so both layouts work: the 6-column v1
  files (``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``) and the
  newer files that add ``Session ID`` and ``Elapsed time`` anywhere in the header.
- ``Total tokens`` is optional (request + response when absent or blank): nothing reads it
  that the two token counts do not give, and hand-made traces leave it out.
- Rows out of time order are sorted, stably (equal timestamps keep their file order): a trace
  concatenated from several files is a valid input. Sorting needs the whole file, so a source
  that can be read twice (a path, a seekable stream) is first scanned for its order; an
  out-of-order stream that cannot be re-read is an error naming the line.
- A malformed row is an error naming its line (a wrong field count, a token count that is not
  a non-negative integer, a timestamp that is not a finite number): a trace that silently loses
  rows would replay a different load.

A sorted file streams: rows are read one at a time, only kept rows are held, and reading stops
at the window's end or ``max_requests``, so multi-million-row files stream. An unsorted one
holds the rows of its window, then yields them in order.

Parameters (defaults):
  models=None (all)          keep rows whose ``Model`` is one of these
  log_types=None (all)       keep rows whose ``Log Type`` is one of these
  start_s=0.0                window start, trace seconds after the earliest timestamp
  duration_s=None (to end)   window length in trace seconds
  max_requests=None          keep at most this many rows (the earliest)
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from _csv import Reader as _Reader

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

    @property
    def conversation(self) -> bool:
        """A ChatGPT-style conversation turn (vs a one-shot API call)."""
        return self.log_type.lower().startswith("conversation")


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
        try:
            return open(source, newline="", encoding="utf-8"), str(source), True  # noqa: SIM115
        except OSError as exc:
            raise TraceError(f"cannot read trace: {exc.strerror or exc}", 0, str(source)) \
                from exc
    return source, getattr(source, "name", "<stream>"), False


def _rewind_point(fh: IO[str]) -> int | None:
    """Where ``fh`` can be sought back to for a second read (None: it cannot)."""
    try:
        return fh.tell() if fh.seekable() else None
    except (AttributeError, OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Columns:
    """Field index of each column in one file's header (None: an optional column is absent)."""

    width: int
    timestamp: int
    model: int
    request: int
    response: int
    log_type: int
    total: int | None
    session: int | None
    elapsed: int | None


def _columns(reader: _Reader, name: str) -> _Columns:
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError("empty file: no header", 0, name) from None
    except csv.Error as exc:
        raise TraceError(f"CSV syntax error: {exc}", reader.line_num, name) from exc
    cols = {h.strip().lower(): i for i, h in enumerate(header)}
    missing = [c for c in REQUIRED_COLUMNS if c.lower() not in cols]
    if missing:
        raise TraceError(f"header lacks column(s) {missing}; got {header}", 1, name)
    return _Columns(len(header), cols[COL_TIMESTAMP.lower()], cols[COL_MODEL.lower()],
                    cols[COL_REQUEST.lower()], cols[COL_RESPONSE.lower()],
                    cols[COL_LOG_TYPE.lower()], cols.get(COL_TOTAL.lower()),
                    cols.get(COL_SESSION.lower()), cols.get(COL_ELAPSED.lower()))


def _records(reader: _Reader, cols: _Columns, name: str) -> Iterator[tuple[int, list[str]]]:
    """(line, fields) of each non-blank data row with the header's field count."""
    try:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != cols.width:
                raise TraceError(f"expected {cols.width} fields, got {len(row)}: {row}",
                                 reader.line_num, name)
            yield reader.line_num, row
    except csv.Error as exc:
        raise TraceError(f"CSV syntax error: {exc}", reader.line_num, name) from exc


def _parse_row(row: list[str], cols: _Columns, line: int, name: str) -> TraceRow:
    req = _parse_int(row[cols.request], COL_REQUEST, line, name)
    resp = _parse_int(row[cols.response], COL_RESPONSE, line, name)
    total = (_parse_int(row[cols.total], COL_TOTAL, line, name)
             if cols.total is not None and row[cols.total].strip() else req + resp)
    session = (row[cols.session].strip() or None) if cols.session is not None else None
    elapsed = (_parse_float(row[cols.elapsed], COL_ELAPSED, line, name)
               if cols.elapsed is not None and row[cols.elapsed].strip() else None)
    return TraceRow(_parse_float(row[cols.timestamp], COL_TIMESTAMP, line, name),
                    row[cols.model].strip(), req, resp, total, row[cols.log_type].strip(),
                    session, elapsed, line)


def _earliest_if_unsorted(fh: IO[str], name: str) -> float | None:
    """First pass over a re-readable source: the earliest timestamp when rows are out of time
    order, None when they are in order (then the second pass streams)."""
    reader = csv.reader(fh)
    cols = _columns(reader, name)
    prev, earliest = -math.inf, math.inf
    in_order = True
    for line, row in _records(reader, cols, name):
        ts = _parse_float(row[cols.timestamp], COL_TIMESTAMP, line, name)
        in_order = in_order and ts >= prev
        prev, earliest = ts, min(earliest, ts)
    return None if in_order else earliest


class _Keep:
    """The order-independent row filters (failed, zero-token, model, log type)."""

    def __init__(self, models: Iterable[str] | None, log_types: Iterable[str] | None) -> None:
        self.models = {m.strip().lower() for m in models} if models else None
        self.log_types = {t.strip().lower() for t in log_types} if log_types else None

    def drop_reason(self, row: TraceRow) -> str | None:
        if row.response_tokens == 0:
            return "failed"
        if row.request_tokens == 0:
            return "zero_request_tokens"
        if self.models is not None and row.model.lower() not in self.models:
            return "model"
        if self.log_types is not None and row.log_type.lower() not in self.log_types:
            return "log_type"
        return None


def read_trace(source: str | Path | IO[str], *, models: Iterable[str] | None = None,
               log_types: Iterable[str] | None = None, start_s: float = 0.0,
               duration_s: float | None = None, max_requests: int | None = None,
               stats: TraceStats | None = None) -> Iterator[TraceRow]:
    """Yield the kept rows of a BurstGPT CSV in time order (see the module docstring).

    Raises :class:`TraceError` naming the line for a malformed row, and for rows out of time
    order in a stream that cannot be read twice.
    """
    stats = stats if stats is not None else TraceStats()
    keep = _Keep(models, log_types)
    fh, name, owned = _open(source)
    stats.source = name
    try:
        rewind = _rewind_point(fh)
        earliest = None
        if rewind is not None:
            earliest = _earliest_if_unsorted(fh, name)
            fh.seek(rewind)
        reader = csv.reader(fh)
        cols = _columns(reader, name)
        stats.layout = f"{cols.width}-column" + (" with sessions" if cols.session is not None
                                                 else "")
        rows = (_parse_row(row, cols, line, name) for line, row in _records(reader, cols, name))
        if earliest is None:
            yield from _in_file_order(rows, keep, start_s, duration_s, max_requests, stats)
        else:
            yield from _sorted(rows, earliest, keep, start_s, duration_s, max_requests, stats)
    finally:
        if owned:
            fh.close()


def _in_file_order(rows: Iterator[TraceRow], keep: _Keep, start_s: float,
                   duration_s: float | None, max_requests: int | None,
                   stats: TraceStats) -> Iterator[TraceRow]:
    prev = -math.inf
    window_start = window_end = math.inf
    kept = 0
    for row in rows:
        stats.rows_read += 1
        if row.timestamp_s < prev:
            raise TraceError(f"timestamp {row.timestamp_s} is before the previous row's {prev}; "
                             "rows out of time order are sorted only in a source that can be "
                             "read twice (a file path)", row.line, stats.source)
        prev = row.timestamp_s
        if stats.first_timestamp_s is None:
            stats.first_timestamp_s = row.timestamp_s
            window_start = row.timestamp_s + start_s
            window_end = window_start + duration_s if duration_s is not None else math.inf
        if row.timestamp_s < window_start:
            stats.drop("before_window")
            continue
        if row.timestamp_s >= window_end:
            break
        reason = keep.drop_reason(row)
        if reason is not None:
            stats.drop(reason)
            continue
        stats.rows_kept += 1
        stats.last_kept_timestamp_s = row.timestamp_s
        yield row
        kept += 1
        if max_requests is not None and kept >= max_requests:
            break


def _sorted(rows: Iterator[TraceRow], earliest: float, keep: _Keep, start_s: float,
            duration_s: float | None, max_requests: int | None,
            stats: TraceStats) -> Iterator[TraceRow]:
    """The rows of the window, sorted stably by timestamp; drops are counted over the whole
    window (a sorted file's reader stops at ``max_requests`` and counts only up to there)."""
    stats.first_timestamp_s = earliest
    window_start = earliest + start_s
    window_end = window_start + duration_s if duration_s is not None else math.inf
    kept: list[TraceRow] = []
    for row in rows:
        stats.rows_read += 1
        if row.timestamp_s < window_start:
            stats.drop("before_window")
            continue
        if row.timestamp_s >= window_end:
            continue
        reason = keep.drop_reason(row)
        if reason is not None:
            stats.drop(reason)
            continue
        kept.append(row)
    kept.sort(key=lambda r: r.timestamp_s)
    del kept[max_requests if max_requests is not None else len(kept):]
    stats.rows_kept = len(kept)
    stats.last_kept_timestamp_s = kept[-1].timestamp_s if kept else None
    yield from kept


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


def native_rate(rows: Sequence[TraceRow]) -> float:
    """Mean arrival rate of time-ordered ``rows`` (requests per second): gaps over span."""
    span = rows[-1].timestamp_s - rows[0].timestamp_s
    return (len(rows) - 1) / span if span > 0 else float(len(rows))


def per_second_counts(offsets: Iterable[float], bin_s: float = 1.0) -> list[int]:
    """Arrivals per ``bin_s`` bin (for burstiness checks and the arrival-rate plot)."""
    counts: list[int] = []
    for t in offsets:
        b = int(t // bin_s)
        if b >= len(counts):
            counts.extend([0] * (b + 1 - len(counts)))
        counts[b] += 1
    return counts


def clamp_to_context(request_tokens: int, response_tokens: int, max_model_len: int
                     ) -> tuple[int, int]:
    """(prompt, output) tokens of a row replayed on a server of ``max_model_len``: a row that
    does not fit keeps at most a quarter of the context for its output and the rest for its
    prompt."""
    if request_tokens + response_tokens <= max_model_len:
        return request_tokens, response_tokens
    out = max(1, min(response_tokens, max_model_len // 4))
    return min(request_tokens, max_model_len - out), out
