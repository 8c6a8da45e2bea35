"""Reports: stable run JSON, requests CSV, markdown, compare table, plots."""

from __future__ import annotations

import json
from pathlib import Path

from bench.client import RequestResult
from bench.metrics import summarize
from bench.report import (
    REQUEST_COLUMNS,
    RUN_SCHEMA,
    compare_table,
    markdown_summary,
    plot_run,
    plot_sweep,
    read_requests_csv,
    run_document,
    write_json,
    write_requests_csv,
)

RESULTS = [
    RequestResult(0, 0.0, 10, 3, sent_s=0.001, lag_s=0.001, token_times_s=[0.1, 0.2, 0.3],
                  output_tokens=3, server_prompt_tokens=10, ok=True, status_code=200),
    RequestResult(1, 0.5, 12, 2, sent_s=0.502, lag_s=0.002, end_s=1.0, ok=False,
                  error_type="timeout", error="no complete response"),
]


def test_run_document_and_files(tmp_path: Path) -> None:
    summary = summarize(RESULTS, 1.0, slo_ttft_s=0.5)
    doc = run_document(summary, {"url": "http://x", "model": "m"}, {"source": "t.csv"})
    assert doc["schema"] == RUN_SCHEMA and doc["requests_failed"] == 1
    assert abs(doc["tpot_p50"] - 0.1) < 1e-9
    write_json(tmp_path / "summary.json", {**doc, "bad": float("nan")})
    back = json.loads((tmp_path / "summary.json").read_text())  # NaN became null: valid JSON
    assert back["bad"] is None and back["config"] == {"url": "http://x", "model": "m"}
    write_requests_csv(tmp_path / "requests.csv", RESULTS, {0: {"trace_line": 7}}, 0.5, None)
    rows = read_requests_csv(tmp_path / "requests.csv")
    assert tuple(rows[0]) == REQUEST_COLUMNS
    assert rows[0]["trace_line"] == "7" and json.loads(rows[0]["token_times_s"]) == [0.1, 0.2, 0.3]
    assert rows[0]["meets_slo"] == "1" and rows[1]["meets_slo"] == "0"
    assert rows[1]["ttft_s"] == "" and rows[1]["error_type"] == "timeout"
    md = markdown_summary(doc)
    assert "| TTFT |" in md and "failed 1" in md


def test_compare_table() -> None:
    a = {"ttft_p50": 0.2, "requests_completed": 10, "goodput_rps": None}
    b = {"ttft_p50": 0.1, "requests_completed": 10, "goodput_rps": None}
    table = compare_table(a, b, ("base", "new"))
    assert "| metric | base | new | change |" in table
    assert "| ttft_p50 | 0.2 | 0.1 | -50.0% |" in table
    assert "goodput_rps" not in table  # absent on both sides


def test_plots(tmp_path: Path) -> None:
    written = plot_run(tmp_path, RESULTS)
    assert {p.name for p in written} == {"latency_cdf.png", "ttft_over_time.png"}
    path = plot_sweep(tmp_path, [{"rate": 1, "slo_attainment": 1.0},
                                 {"rate": 2, "slo_attainment": 0.5}], 0.9)
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
