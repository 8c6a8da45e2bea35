"""BurstGPT reader: both layouts, the real published rows, filters, windows, bad rows, streaming."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Iterator

import pytest

from bench.synth import SynthConfig, synth_rows
from bench.trace import (
    TraceError,
    TraceRow,
    TraceStats,
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
    ("9,ChatGPT,10,5,15,API log\n3,ChatGPT,10,5,15,API log\n", 3, "sorted"),
    ("x,ChatGPT,10,5,15,API log\n", 2, "'Timestamp'"),
])
def test_bad_rows_name_their_line(body: str, line: int, fragment: str) -> None:
    with pytest.raises(TraceError) as info:
        rows_of(V1_HEADER + body)
    assert info.value.line == line
    assert f":{line}:" in str(info.value) and fragment in str(info.value)


def test_missing_column_and_empty_file() -> None:
    with pytest.raises(TraceError, match="Response tokens"):
        rows_of("Timestamp,Model,Request tokens,Log Type\n1,ChatGPT,3,API log\n")
    with pytest.raises(TraceError, match="empty"):
        rows_of("")


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
