"""BurstGPT reader: both layouts, the real published rows, filters, windows, bad rows, sorting,
streaming."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.synth import SynthConfig, synth_rows
from bench.trace import (
    TraceError,
    TraceRow,
    TraceStats,
    native_rate,
    per_second_counts,
    read_trace,
    schedule,
    trace_to_text,
    write_trace,
)

V1_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
# The three rows published in BurstGPT's README.
REAL_ROWS = ("5,ChatGPT,472,18,490,Conversation log\n"
             "45,ChatGPT,1087,230,1317,Conversation log\n"
             "118,GPT-4,417,276,693,Conversation log\n")


def rows_of(text: str, **kw: object) -> tuple[list[TraceRow], TraceStats]:
    stats = TraceStats()
    rows = list(read_trace(io.StringIO(text), stats=stats, **kw))  # type: ignore[arg-type]
    return rows, stats


def test_real_burstgpt_rows_round_trip() -> None:
    rows, stats = rows_of(V1_HEADER + REAL_ROWS)
    assert [(r.timestamp_s, r.model, r.request_tokens, r.response_tokens, r.total_tokens,
             r.log_type) for r in rows] == [
        (5.0, "ChatGPT", 472, 18, 490, "Conversation log"),
        (45.0, "ChatGPT", 1087, 230, 1317, "Conversation log"),
        (118.0, "GPT-4", 417, 276, 693, "Conversation log")]
    assert [r.line for r in rows] == [2, 3, 4]
    assert stats.layout == "6-column" and stats.rows_kept == 3 and stats.dropped == {}
    assert trace_to_text(rows) == V1_HEADER + REAL_ROWS


def test_v2_layout_parsed_by_name_in_any_column_order() -> None:
    text = ("Session ID,Elapsed time,Log Type,Total tokens,Response tokens,Request tokens,"
            "Model,Timestamp\n"
            "abc,3.5,Conversation log,490,18,472,ChatGPT,5\n"
            ",0.9,API log,100,20,80,GPT-4,6.25\n")
    rows, stats = rows_of(text)
    assert rows[0] == TraceRow(5.0, "ChatGPT", 472, 18, 490, "Conversation log", "abc", 3.5, 2)
    assert rows[1] == TraceRow(6.25, "GPT-4", 80, 20, 100, "API log", None, 0.9, 3)
    assert stats.layout == "8-column with sessions"
    # Our own v2 writer round-trips too.
    again, _ = rows_of(trace_to_text(rows, layout="v2"))
    assert again == rows


def test_zero_token_and_failed_rows_are_counted_per_reason() -> None:
    text = V1_HEADER + ("1,ChatGPT,10,0,10,Conversation log\n"   # failed
                        "2,ChatGPT,0,5,5,API log\n"               # zero request tokens
                        "3,GPT-4,10,5,15,API log\n"
                        "4,ChatGPT,10,5,15,API log\n")
    rows, stats = rows_of(text, models=["gpt-4"])
    assert [r.timestamp_s for r in rows] == [3.0]
    assert stats.dropped == {"failed": 1, "zero_request_tokens": 1, "model": 1}
    assert stats.rows_read == 4
    rows, stats = rows_of(text, log_types=["Conversation log"])
    assert rows == []
    assert stats.dropped == {"failed": 1, "zero_request_tokens": 1, "log_type": 2}


@pytest.mark.parametrize(("body", "line", "fragment"), [
    ("1,ChatGPT,10,5,15,API log\n2,ChatGPT,ten,5,15,API log\n", 3, "'Request tokens'"),
    ("1,ChatGPT,10,5,15,API log\n2,ChatGPT,10,5,API log\n", 3, "expected 6 fields"),
    ("1,ChatGPT,10,-5,5,API log\n", 2, "non-negative integer"),
    ("1,ChatGPT,10.5,5,15,API log\n", 2, "non-negative integer"),
    ("x,ChatGPT,10,5,15,API log\n", 2, "'Timestamp'"),
])
def test_bad_rows_name_their_line(body: str, line: int, fragment: str) -> None:
    with pytest.raises(TraceError) as info:
        rows_of(V1_HEADER + body)
    assert info.value.line == line
    assert f":{line}:" in str(info.value) and fragment in str(info.value)


def test_missing_column_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="Response tokens") as info:
        rows_of("Timestamp,Model,Request tokens,Log Type\n1,ChatGPT,3,API log\n")
    assert info.value.line == 1 and "header lacks column(s) ['Response tokens']" in str(info.value)
    with pytest.raises(TraceError, match="empty"):
        rows_of("")
    with pytest.raises(TraceError, match="cannot read trace"):
        list(read_trace(tmp_path / "absent.csv"))


def test_total_tokens_is_optional() -> None:
    rows, _ = rows_of("Timestamp,Model,Request tokens,Response tokens,Log Type\n"
                      "1,ChatGPT,10,5,API log\n")
    assert rows == [TraceRow(1.0, "ChatGPT", 10, 5, 15, "API log", line=2)]


UNSORTED = V1_HEADER + ("30,ChatGPT,5000,9000,14000,Conversation log\n"
                        "10,ChatGPT,100,20,120,Conversation log\n"
                        "20,GPT-4,50,0,50,API log\n"       # failed: dropped
                        "10,GPT-4,7,3,10,API log\n"        # same time as line 3: after it
                        "40,GPT-4,8,3,11,API log\n")


def test_unsorted_rows_are_sorted_stably(tmp_path: Path) -> None:
    """Two traces concatenated: every source that can be read twice gives the rows in time
    order, equal timestamps in file order; windows count from the earliest timestamp."""
    path = tmp_path / "cat.csv"
    path.write_text(UNSORTED)
    for source in (path, io.StringIO(UNSORTED)):
        stats = TraceStats()
        rows = list(read_trace(source, stats=stats))  # type: ignore[arg-type]
        assert [(r.timestamp_s, r.line) for r in rows] == [(10.0, 3), (10.0, 5), (30.0, 2),
                                                            (40.0, 6)]
        assert stats.first_timestamp_s == 10.0 and stats.last_kept_timestamp_s == 40.0
        assert stats.rows_read == 5 and stats.rows_kept == 4 and stats.dropped == {"failed": 1}
    rows, stats = rows_of(UNSORTED, start_s=5, duration_s=30)  # [15, 45)
    assert [r.timestamp_s for r in rows] == [30.0, 40.0]
    assert stats.dropped == {"before_window": 2, "failed": 1}
    rows, _ = rows_of(UNSORTED, max_requests=2)  # the earliest two, not the first two lines
    assert [r.line for r in rows] == [3, 5]


class _OneShot(io.StringIO):
    """A stream that cannot be sought (a pipe)."""

    def seekable(self) -> bool:
        return False


def test_unsorted_stream_that_cannot_be_reread_names_the_line() -> None:
    with pytest.raises(TraceError, match="out of time order") as info:
        list(read_trace(_OneShot(UNSORTED)))  # type: ignore[arg-type]
    assert info.value.line == 3
    # negative control: the same stream in order reads fine
    assert len(list(read_trace(_OneShot(V1_HEADER + REAL_ROWS)))) == 3  # type: ignore[arg-type]


def test_write_then_read_keeps_sessions_and_conversation_flag(tmp_path: Path) -> None:
    rows = [TraceRow(1.5, "ChatGPT", 100, 20, 120, "Conversation log", "s1"),
            TraceRow(2.25, "GPT-4", 50, 5, 55, "API log")]
    path = tmp_path / "t.csv"
    write_trace(rows, path, layout="v2")
    back = list(read_trace(path))
    assert [(r.timestamp_s, r.session_id, r.conversation) for r in back] == [
        (1.5, "s1", True), (2.25, None, False)]


def test_native_rate_is_gaps_over_span() -> None:
    assert native_rate([_row(t) for t in (10.0, 12.0, 14.0)]) == 1.0 / 2.0
    assert native_rate([_row(5.0), _row(5.0)]) == 2.0  # no span: the count


def test_window_and_max_requests() -> None:
    text = V1_HEADER + "".join(f"{t},ChatGPT,10,5,15,API log\n" for t in range(100, 120))
    rows, stats = rows_of(text, start_s=5, duration_s=3)
    assert [r.timestamp_s for r in rows] == [105.0, 106.0, 107.0]
    assert stats.dropped == {"before_window": 5} and stats.first_timestamp_s == 100.0
    rows, _ = rows_of(text, max_requests=2)
    assert len(rows) == 2


def _row(t: float) -> TraceRow:
    return TraceRow(t, "ChatGPT", 10, 5, 15, "API log")


def test_time_scale_and_rate_keep_the_shape() -> None:
    rows = [_row(t) for t in (100.0, 101.0, 101.5, 110.0)]
    sched, scale = schedule(rows, time_scale=10)
    assert scale == 10 and [s.at_s for s in sched] == [0.0, 0.1, 0.15, 1.0]
    # 3 gaps over 10 s = 0.3 req/s; target 3 req/s -> 10x faster.
    sched, scale = schedule(rows, rate=3.0)
    assert scale == pytest.approx(10.0)
    assert [s.at_s for s in sched] == pytest.approx([0.0, 0.1, 0.15, 1.0])
    # With an explicit window, the trace rate is rows / window.
    _, scale = schedule(rows, rate=2.0, duration_s=20.0)
    assert scale == pytest.approx(2.0 / (4 / 20.0))
    with pytest.raises(ValueError):
        schedule(rows, time_scale=2, rate=2)


def test_per_second_counts() -> None:
    assert per_second_counts([0.1, 0.2, 2.5, 2.9, 2.0]) == [2, 0, 3]


class _LazyCsv:
    """A file object that generates an endless trace line by line and counts what is read."""

    name = "<endless>"

    def __init__(self) -> None:
        self.lines_served = 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        self.lines_served += 1
        if self.lines_served == 1:
            return V1_HEADER
        return f"{self.lines_served * 0.5},ChatGPT,10,5,15,API log\n"



def test_endless_file_is_streamed_not_loaded() -> None:
    src = _LazyCsv()
    it = read_trace(src, duration_s=10.0)  # type: ignore[arg-type]
    first = next(it)
    assert first.timestamp_s == 1.0 and src.lines_served == 2  # nothing read ahead
    rest = list(it)
    assert len(rest) == 19 and src.lines_served < 30  # stops at the end of the window


def test_200k_row_file_streams_in_bounded_memory(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "big.csv"  # type: ignore[operator]
    n = write_trace(synth_rows(SynthConfig(duration_s=20000, rate=10, dispersion=1.0, seed=3)),
                    path, layout="v2")
    assert n > 190_000
    size = path.stat().st_size
    stats = TraceStats()
    tracemalloc.start()
    kept = sum(1 for _ in read_trace(path, models=["nope"], stats=stats))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert kept == 0 and stats.rows_read == n and stats.dropped["model"] > 0
    assert peak < size / 20, (peak, size)  # a whole-file read would need > size
