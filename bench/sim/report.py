"""Writes ``summary.json``, ``report.md`` and the PNG plots of one comparison."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.goodput_workloads import sustained_rate
from bench.sim.bench_workloads import PREFIX
from router.policy.registry import BASELINES

if TYPE_CHECKING:
    from bench.sim.paths import Row


def write_summary(out: Path, summary: Mapping[str, Mapping[str, Any]]) -> Path:
    """``DIR/summary.json``: policy name -> metrics."""
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return path


def comparison_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown table; capacity ratio against the best baseline present."""
    base = [summary[n]["effective_capacity_rps"] for n in BASELINES if n in summary]
    best = max(base) if base else 0.0
    head = ("| policy | effective capacity (req/s) | vs best baseline | TTFT p50 (s) | "
            "TTFT p99 (s) | SLO attainment | cache hit ratio | load max/mean |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, m in summary.items():
        ratio = f"{m['effective_capacity_rps'] / best:.2f}x" if best else "n/a"
        lines.append(f"| {name} | {m['effective_capacity_rps']:.2f} | {ratio} | "
                     f"{m['ttft_p50']:.3f} | {m['ttft_p99']:.3f} | {m['slo_attainment']:.3f} | "
                     f"{m['cache_hit_ratio']:.3f} | {m['load_max_over_mean']:.2f} |")
    return head + "\n".join(lines) + "\n"


def write_report(out: Path, summary: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any],
                 curves: Mapping[str, Sequence[tuple[float, float]]],
                 ttfts: Mapping[str, Sequence[float]],
                 loads: Mapping[str, Mapping[str, float]]) -> list[Path]:
    """``report.md`` plus ``attainment.png``, ``ttft_cdf.png`` and ``load.png``."""
    from bench.report import require_pyplot

    plt = require_pyplot()

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        ax.plot([r for r, _ in pts], [a for _, a in pts], marker="o", label=name)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel(f"share with TTFT <= {meta['slo_ttft_s']} s")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "attainment.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, xs in ttfts.items():
        s = sorted(xs)
        if s:
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT (s) at {meta['reference_rps']:.2f} req/s")
    ax.set_ylabel("CDF")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(loads)
    ax.bar(names, [max(v.values()) / (sum(v.values()) / len(v)) if v and sum(v.values()) else 0
                   for v in loads.values()])
    ax.set_ylabel("prefill busy time, max / mean instance")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(out / "load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    md = [f"# Simulated prefill placement: {', '.join(summary)}", "",
          f"Trace `{meta['trace']}` ({meta['requests']} requests), {meta['n_prefill']} prefill / "
          f"{meta['n_decode']} decode instances, TTFT SLO {meta['slo_ttft_s']} s, TPOT SLO "
          f"{meta['slo_tpot_s']} s, seed {meta['seed']}.", "",
          "Effective capacity = highest arrival rate with >= 90 % of requests within the TTFT "
          "SLO (rate sweep). The other columns are measured at the reference rate "
          f"{meta['reference_rps']:.2f} req/s (the best baseline's capacity).", "",
          comparison_table(summary), "",
          "![SLO attainment vs rate](attainment.png)", "![TTFT CDF](ttft_cdf.png)",
          "![load spread](load.png)", ""]
    paths.append(out / "report.md")
    paths[-1].write_text("\n".join(md))
    return paths


def autoscale_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown table of autoscaled runs (``pdserve sim --autoscale``)."""
    head = ("| policy | autoscaler | SLO attainment (both) | TTFT only | TPOT only | "
            "instance-s (prefill + decode) | replicas max (P+D) | TTFT p99 (s) |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, m in summary.items():
        inst, mx = m["instance_seconds"], m["replicas_max"]
        lines.append(f"| {name} | {m['autoscale']} | {m['slo_attainment']:.4f} | "
                     f"{m['slo_attainment_ttft']:.4f} | {m['slo_attainment_tpot']:.4f} | "
                     f"{inst['total']:.0f} ({inst['prefill']:.0f} + {inst['decode']:.0f}) | "
                     f"{mx['prefill']}+{mx['decode']} | {m['ttft_p99']:.3f} |")
    return head + "\n".join(lines) + "\n"


def write_autoscale_report(out: Path, summary: Mapping[str, Mapping[str, Any]],
                           meta: Mapping[str, Any]) -> Path:
    """``report.md`` of an autoscaled replay (the plot ``replicas.png`` is written beside)."""
    md = [f"# Simulated autoscaling ({meta['autoscale']}): {', '.join(summary)}", "",
          f"Trace `{meta['trace']}` ({meta['requests']} requests) replayed at its own timing; "
          f"pools of at most {meta['max_prefill']} prefill / {meta['max_decode']} decode "
          f"instances (from {meta['min']} each unless static), TTFT SLO {meta['slo_ttft_s']} s, "
          f"TPOT SLO {meta['slo_tpot_s']} s, seed {meta['seed']}.", "",
          "Instance-seconds are billed from the scale-up decision (including the worker start) "
          "until a drained instance finished its last request.", "",
          autoscale_table(summary), "", "![replicas over time](replicas.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def paths_table(rows: Sequence[Row]) -> str:
    """Markdown table of ``pdserve sim paths``: mean capacity (req/s) over the seeds per
    workload and fleet, adaptive's ratio to the best other fleet, adaptive's P/D share at its
    capacity."""
    fleets = list(rows[0].capacity_rps) if rows else []
    head = ("| workload | " + " | ".join(fleets) + " | adaptive / best static | "
            "adaptive P/D share |\n|---|" + "---|" * (len(fleets) + 2) + "\n")
    lines = []
    for row in rows:
        mean = {f: sum(c) / len(c) for f, c in row.capacity_rps.items()}
        static = [v for f, v in mean.items() if not f.startswith("adaptive")]
        best = max(static, default=0.0)
        ratio = (f"{mean['adaptive'] / best:.2f}x" if "adaptive" in mean and best else "n/a")
        share = (f"{sum(row.adaptive_pd_share) / len(row.adaptive_pd_share):.0%}"
                 if row.adaptive_pd_share else "n/a")
        lines.append(f"| {row.workload} | " + " | ".join(f"{mean[f]:.1f}" for f in fleets)
                     + f" | {ratio} | {share} |")
    return head + "\n".join(lines) + "\n"


def paths_ranking(rows: Sequence[Row]) -> str:
    """One line per workload: the fleets from the highest mean capacity down."""
    out = []
    for row in rows:
        mean = {f: sum(c) / len(c) for f, c in row.capacity_rps.items()}
        order = sorted(mean, key=lambda f: -mean[f])
        out.append(f"{row.workload}: " + " > ".join(order))
    return "\n".join(out) + "\n"


REAL_SETUPS: dict[str, str] = {"aggregated": "aggregated", "pd": "pd1:1", "adaptive": "adaptive"}
"""``bench.pd_goodput`` setup -> the simulated fleet of the same engines (N aggregated, static
P/D one to one, N flex). plain, selective and vllm_pd have none."""
TIE_SHARE = 0.05
"""Simulated capacities within this share of each other rank as tied (the real table's
bisection resolves ~5 %)."""


def real_capacities(goodput: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]
                    ) -> dict[str, dict[str, float]]:
    """``bench.pd_goodput``'s ``goodput.json`` -> workload -> setup -> sustained req/s (the
    lower of its runs, as the benchmark's table reads it; 0 when none passed)."""
    return {w: {s: sustained_rate(runs) for s, runs in by_setup.items() if runs}
            for w, by_setup in goodput.items()}


def _order(a: float, b: float, tie_share: float) -> int:
    """1 when ``a`` ranks above ``b``, -1 below, 0 when within ``tie_share`` of the larger."""
    if abs(a - b) <= tie_share * max(abs(a), abs(b)):
        return 0
    return 1 if a > b else -1


def ranking_agreement(rows: Sequence[Row], real: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown table: for every simulated ``bench:<name>`` workload the real table also
    measured, each setup's real and simulated capacity and how many pairs of setups the two
    order alike (ties: equal real rates; simulated ones within :data:`TIE_SHARE`)."""
    head = ("| workload | setup: real / simulated req/s | pairs ordered alike | best (real; "
            "simulated) |\n|---|---|---|---|\n")
    lines = []
    for row in rows:
        name = row.workload.removeprefix(PREFIX)
        measured = real.get(name)
        if row.workload == name or not measured:
            continue
        sim = {f: sum(c) / len(c) for f, c in row.capacity_rps.items() if c}
        both = [s for s in REAL_SETUPS if s in measured and REAL_SETUPS[s] in sim]
        pairs = [(a, b) for i, a in enumerate(both) for b in both[i + 1:]]
        alike = sum(_order(measured[a], measured[b], 0.0)
                    == _order(sim[REAL_SETUPS[a]], sim[REAL_SETUPS[b]], TIE_SHARE)
                    for a, b in pairs)
        cells = ", ".join(f"{s} {measured[s]:.2f} / {sim[REAL_SETUPS[s]]:.2f}" for s in both)
        best_real = max(both, key=lambda s: measured[s], default="-")
        best_sim = max(both, key=lambda s: sim[REAL_SETUPS[s]], default="-")
        lines.append(f"| {name} | {cells} | {alike} of {len(pairs)} | {best_real}; "
                     f"{best_sim} |")
    return head + "\n".join(lines) + "\n" if lines else ""
