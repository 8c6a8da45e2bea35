"""Run outputs: per-request CSV, the run JSON (stable schema), PNG plots, markdown, compare.

``summary.json`` holds the flat metrics of :func:`bench.metrics.summarize` at the top level
(times in seconds), plus ``schema``, ``created``, ``config`` (how the run was made) and
``trace`` (what the reader kept and dropped). New keys may be added; existing keys keep their
names and meaning while ``schema`` stays ``pdserve.bench.run/1``.
"""

from __future__ import annotations

import csv
import datetime as dt
import importlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.client import RequestResult
from bench.metrics import meets_slo

logger = logging.getLogger(__name__)

RUN_SCHEMA = "pdserve.bench.run/1"
SWEEP_SCHEMA = "pdserve.bench.sweep/1"
REQUEST_COLUMNS = ("index", "trace_line", "session_id", "scheduled_s", "sent_s", "lag_s",
                   "queue_s", "prompt_tokens", "server_prompt_tokens", "max_tokens",
                   "output_tokens", "ok", "error_type", "status_code", "ttft_s", "tpot_s",
                   "e2e_s", "meets_slo", "token_times_s", "error")
COMPARE_KEYS = ("requests_scheduled", "requests_completed", "requests_failed",
                "request_throughput_rps", "output_token_throughput_tps", "ttft_p50", "ttft_p99",
                "tpot_p50", "tpot_p99", "itl_p50", "e2e_p50", "e2e_p99", "slo_attainment",
                "goodput_rps", "schedule_lag_p99")


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf -> None, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _num(x: float | None) -> str:
    return "" if x is None or x != x else repr(round(x, 6))


def write_requests_csv(path: Path, results: Sequence[RequestResult],
                       meta: dict[int, dict[str, Any]] | None = None,
                       slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> None:
    """One row per request; ``token_times_s`` is a JSON list of seconds after send."""
    meta = meta or {}
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        for r in results:
            m = meta.get(r.index, {})
            w.writerow([r.index, m.get("trace_line", ""), m.get("session_id") or "",
                        _num(r.scheduled_s), _num(r.sent_s), _num(r.lag_s), _num(r.queue_s),
                        r.prompt_tokens,
                        "" if r.server_prompt_tokens is None else r.server_prompt_tokens,
                        r.max_tokens, r.output_tokens, int(r.ok), r.error_type, r.status_code,
                        _num(r.ttft_s), _num(r.tpot_s), _num(r.e2e_s),
                        int(meets_slo(r, slo_ttft_s, slo_tpot_s)),
                        json.dumps([round(t, 6) for t in r.token_times_s]), r.error[:300]])


def read_requests_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a ``requests.csv`` as dicts of strings."""
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def run_document(summary: dict[str, Any], config: dict[str, Any],
                 trace: dict[str, Any]) -> dict[str, Any]:
    """The run JSON: flat metrics plus schema, creation time, config and trace metadata."""
    doc = {"schema": RUN_SCHEMA,
           "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           **summary, "config": config, "trace": trace}
    return _clean(doc)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(_clean(doc), indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_summary(doc: dict[str, Any]) -> str:
    """A short human report of one run."""
    cfg, tr = doc.get("config", {}), doc.get("trace", {})
    lines = [f"# Benchmark run: {cfg.get('url', '?')} ({cfg.get('model', '?')})", "",
             f"- trace: `{tr.get('source', '?')}` ({tr.get('layout', '?')}), "
             f"rows read {tr.get('rows_read', '?')}, kept {tr.get('rows_kept', '?')}, "
             f"dropped {tr.get('dropped', {})}",
             f"- time scale: {_fmt(tr.get('time_scale'))}, offered rate: "
             f"{_fmt(tr.get('offered_rate_rps'))} req/s",
             f"- requests: scheduled {doc['requests_scheduled']}, completed "
             f"{doc['requests_completed']}, failed {doc['requests_failed']} "
             f"{doc.get('errors') or ''}",
             f"- duration {_fmt(doc['duration_s'])} s; throughput "
             f"{_fmt(doc['request_throughput_rps'])} req/s, "
             f"{_fmt(doc['output_token_throughput_tps'])} output tok/s",
             f"- SLO (TTFT <= {_fmt(doc.get('slo_ttft_s'))} s, TPOT <= "
             f"{_fmt(doc.get('slo_tpot_s'))} s): attainment {_fmt(doc['slo_attainment'])}, "
             f"goodput {_fmt(doc['goodput_rps'])} req/s",
             f"- schedule lag p99 {_fmt(doc['schedule_lag_p99'])} s, max "
             f"{_fmt(doc.get('schedule_lag_max'))} s: timing "
             f"{'valid' if doc.get('timing_valid', True) else 'INVALID (the client fell behind)'}"
             f"; waits for a --max-concurrency slot p99 {_fmt(doc.get('client_queue_p99'))} s",
             "",
             "| metric (s) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        lines.append(f"| {name.upper()} | " + " | ".join(
            _fmt(doc.get(f"{name}_{s}")) for s in ("mean", "p50", "p90", "p99")) + " |")
    return "\n".join(lines) + "\n"


def compare_table(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("a", "b"),
                  keys: Sequence[str] = COMPARE_KEYS) -> str:
    """Side-by-side markdown table of two run (or sweep) documents with the relative change."""
    rows = [f"| metric | {names[0]} | {names[1]} | change |", "|---|---|---|---|"]
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if va is None and vb is None:
            continue
        change = ""
        if isinstance(va, int | float) and isinstance(vb, int | float) and va:
            change = f"{(vb - va) / abs(va) * 100:+.1f}%"
        rows.append(f"| {k} | {_fmt(va)} | {_fmt(vb)} | {change} |")
    return "\n".join(rows) + "\n"


BENCH_EXTRA = "pip install 'pdserve[bench]'"


def require_optional(module: str) -> Any:
    """Import ``module``, an optional dependency of the ``bench`` extra (matplotlib, rich),
    or fail saying how to install it: serve/ and router/ never need it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed; it comes with the bench extra: "
                          f"{BENCH_EXTRA}") from exc


def require_pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (the ``bench`` extra)."""
    require_optional("matplotlib").use("Agg")
    return require_optional("matplotlib.pyplot")


def _pyplot() -> Any | None:
    try:
        return require_pyplot()
    except ImportError as exc:
        logger.warning("no PNG plots: %s", exc)
        return None


def plot_run(out_dir: Path, results: Sequence[RequestResult]) -> list[Path]:
    """latency_cdf.png and ttft_over_time.png; returns the files written."""
    plt = _pyplot()
    if plt is None:
        return []
    ok = [r for r in results if r.ok]
    written: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (label, vals) in zip(axes, (
            ("TTFT (s)", [r.ttft_s for r in ok]), ("TPOT (s)", [r.tpot_s for r in ok]),
            ("E2E (s)", [r.e2e_s for r in ok])), strict=True):
        xs = sorted(v for v in vals if v is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=6, label="TTFT")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("TTFT (s)")
    ax2 = ax.twinx()
    horizon = max((r.scheduled_s for r in results), default=0.0)
    bin_s = max(1.0, horizon / 60)
    nbins = int(horizon // bin_s) + 1
    counts = [0] * nbins
    for r in results:
        counts[min(nbins - 1, int(r.scheduled_s // bin_s))] += 1
    ax2.step([i * bin_s for i in range(nbins)], [c / bin_s for c in counts], where="post",
             color="tab:orange", label="arrival rate")
    ax2.set_ylabel("arrivals (req/s)")
    fig.legend(loc="upper left")
    fig.tight_layout()
    path = out_dir / "ttft_over_time.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def plot_sweep(out_dir: Path, points: Sequence[dict[str, Any]], target: float) -> Path | None:
    """attainment_vs_rate.png from sweep points ({"rate", "slo_attainment"})."""
    plt = _pyplot()
    if plt is None:
        return None
    pts = sorted(points, key=lambda p: p["rate"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["rate"] for p in pts], [p["slo_attainment"] for p in pts], marker="o")
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target:.0%}")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "attainment_vs_rate.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
