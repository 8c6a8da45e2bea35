"""``pdserve sim``: compare prefill placement policies on a BurstGPT trace in simulation.

    pdserve sim --trace FILE.csv --prefill N --decode M --policies dualmap,round_robin,...
                [--ttft-slo-s SECONDS] [--tpot-slo-s SECONDS] --out DIR [--seed S]
                [--autoscale planner|threshold|static [--min N] [--autoscale-interval-s 10]
                 [--start-delay-s 30] [--profile-bias 1.0]]

Without ``--autoscale``: a rate sweep per policy on fixed pools; writes ``DIR/summary.json``
(policy -> effective_capacity_rps, ttft_p50, ttft_p99, slo_attainment, cache_hit_ratio,
load_max_over_mean, ...), ``DIR/report.md`` and PNG plots.

With ``--autoscale``: each policy replays the trace once at its own timing, the pools sized by
the autoscaler (``static``: fixed at ``--prefill``/``--decode``; ``planner`` or ``threshold``:
from ``--min`` each up to those sizes, re-planned every ``--autoscale-interval-s``, added
instances serving after ``--start-delay-s``). ``DIR/summary.json`` per policy then holds
``instance_seconds`` (total, prefill, decode), ``slo_attainment`` (share of requests within
both SLOs), ``replicas_max`` (per pool), latency percentiles; ``DIR/replicas.png`` plots the
pools over time and ``DIR/report.md`` has the table.

``pdserve sim paths ...`` compares adaptive disaggregation with aggregated and static P/D
fleets instead (:mod:`bench.sim.paths_cli`).

Unknown policy, bad trace or bad numbers: a message on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.sim.autoscale import (
    AUTOSCALERS,
    AutoscaleSettings,
    arrival_rate,
    autoscale_summary,
    make_controller,
    plot_replicas,
)
from bench.sim.engine import RunResult, simulate
from bench.sim.report import (
    autoscale_table,
    comparison_table,
    write_autoscale_report,
    write_report,
    write_summary,
)
from bench.sim.sweep import (
    SweepConfig,
    effective_capacity,
    make_policy,
    run_at,
    starting_rate,
    summarize,
)
from bench.sim.workload import SimRequest, WorkloadConfig, build_requests
from bench.trace import TraceError, native_rate, read_trace
from router import settings as shared
from router.autoscale.profile import InstanceProfile
from router.errors import ConfigError
from router.policy.registry import BASELINES, PREFILL_POLICIES

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="BurstGPT-format CSV")
    p.add_argument("--prefill", type=int, required=True, help="prefill instances")
    p.add_argument("--decode", type=int, required=True, help="decode instances")
    p.add_argument("--policies", required=True,
                   help=f"comma-separated, from: {', '.join(PREFILL_POLICIES)}")
    shared.add_arguments(p, "sim")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="prefix-model seed (default 0)")
    p.add_argument("--limit", type=int, default=None, help="use the earliest N usable trace rows")
    p.add_argument("--calibration", default=None,
                   help="instance profile JSON (`pdserve bench profile` writes one)")
    p.add_argument("--hot-share", type=float, default=0.0,
                   help="share of requests on one system prompt (default 0)")
    p.add_argument("--no-rebalance", action="store_true",
                   help="never move queued requests to their alternate candidate")
    p.add_argument("--autoscale", default=None,
                   help=f"size the pools during one replay: {', '.join(AUTOSCALERS)} "
                        "(default: no replay, a rate sweep on fixed pools)")
    p.add_argument("--min", type=int, default=1, dest="min_replicas",
                   help="autoscaled pools start at and never go below this (default 1)")
    p.add_argument("--autoscale-interval-s", type=float, default=10.0,
                   help="simulated seconds between autoscaler decisions (default 10)")
    p.add_argument("--start-delay-s", type=float, default=30.0,
                   help="an added instance serves this long after the decision (default 30)")
    p.add_argument("--profile-bias", type=float, default=1.0,
                   help="multiply the planner's profiled times by this (default 1.0 = exact; "
                        "e.g. 0.5 = optimistic profile, for the online correction to fix)")
    return p


def _fail(msg: str) -> int:
    print(f"pdserve sim: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    # progress goes to stderr as INFO lines; `pdserve sim` runs this before `pdserve` configures
    # logging, and a run of many minutes with no line is indistinguishable from a hung one
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["paths"]:
        from bench.sim.paths_cli import main as paths_main

        return paths_main(argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    try:
        shared.resolve_into(args, "sim")
    except ConfigError as exc:
        return _fail(str(exc))
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in PREFILL_POLICIES]
    if not names or unknown:
        return _fail(f"unknown policy {', '.join(unknown) or '(none given)'}; allowed: "
                     f"{', '.join(sorted(PREFILL_POLICIES))}")
    if args.prefill < 1 or args.decode < 1 or args.ttft_slo_s <= 0 or args.tpot_slo_s <= 0:
        return _fail("--prefill and --decode must be >= 1 and the SLOs > 0")
    try:
        rows = list(read_trace(args.trace, max_requests=args.limit))
    except TraceError as exc:
        return _fail(str(exc))
    if len(rows) < 10:
        return _fail(f"{args.trace} has only {len(rows)} usable rows (need >= 10)")
    try:
        profile = InstanceProfile.load(args.calibration) if args.calibration else InstanceProfile()
    except ConfigError as exc:
        return _fail(str(exc))
    prefill, decode = profile.prefill, profile.decode
    cfg = SweepConfig(args.prefill, args.decode, args.ttft_slo_s, args.tpot_slo_s, prefill, decode,
                      rebalance=not args.no_rebalance)
    settings = None
    if args.autoscale is not None:
        try:
            settings = AutoscaleSettings(
                args.autoscale, args.prefill, args.decode, args.min_replicas,
                args.autoscale_interval_s, args.start_delay_s, args.profile_bias)
        except ValueError as exc:
            return _fail(str(exc))
    reqs = build_requests(rows, WorkloadConfig(hot_share=args.hot_share,
                                               block_tokens=prefill.block_tokens), args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if settings is not None:
        return _replay(names, reqs, cfg, settings, out, args)
    native = native_rate(rows)
    start = starting_rate(reqs, cfg)
    caps: dict[str, float] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    for name in names:
        caps[name], curves[name] = effective_capacity(name, reqs, cfg, native, start,
                                                      progress=logger.info)
    base = [caps[n] for n in BASELINES if n in caps]
    reference = max(base) if base else max(caps.values())
    reference = reference or start
    summary: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    loads: dict[str, dict[str, float]] = {}
    for name in names:
        res = run_at(name, reqs, cfg, reference, native)
        summary[name] = {"effective_capacity_rps": caps[name], "reference_rps": reference,
                         **summarize(res, cfg)}
        ttfts[name], loads[name] = res.ttft_s, res.busy_s
    meta = {"trace": args.trace, "requests": len(reqs), "n_prefill": args.prefill,
            "n_decode": args.decode, "slo_ttft_s": args.ttft_slo_s, "slo_tpot_s": args.tpot_slo_s,
            "seed": args.seed, "reference_rps": reference}
    write_summary(out, summary)
    write_report(out, summary, meta, curves, ttfts, loads)
    print(comparison_table(summary) + f"\nwrote {out / 'report.md'} (summary.json and plots "
          "beside it)", flush=True)
    return 0


def _replay(names: list[str], reqs: list[SimRequest], cfg: SweepConfig,
            settings: AutoscaleSettings, out: Path, args: argparse.Namespace) -> int:
    """One autoscaled replay per policy at the trace's own timing."""
    ctx = statistics.fmean(r.prompt_tokens for r in reqs)
    summary: dict[str, dict[str, Any]] = {}
    runs: dict[str, RunResult] = {}
    for name in names:
        controller = make_controller(settings, cfg.ttft_slo_s, cfg.tpot_slo_s,
                                     InstanceProfile(cfg.prefill, cfg.decode), ctx)
        threshold = cfg.ttft_slo_s if cfg.rebalance else None
        res = simulate(reqs, make_policy(name, cfg), cfg.n_prefill, cfg.n_decode, cfg.prefill,
                       cfg.decode, rebalance_threshold_s=threshold, controller=controller,
                       start_delay_s=settings.start_delay_s)
        runs[name] = res
        summary[name] = {"autoscale": settings.mode,
                         **autoscale_summary(res, cfg.ttft_slo_s, cfg.tpot_slo_s)}
        logger.info("%s/%s: attainment %.4f, %.0f instance-s", name, settings.mode,
                    summary[name]["slo_attainment"], summary[name]["instance_seconds"]["total"])
    write_summary(out, summary)
    plot_replicas(out / "replicas.png", runs, arrival_rate([r.arrival_s for r in reqs]))
    meta = {"trace": args.trace, "requests": len(reqs), "autoscale": settings.mode,
            "max_prefill": settings.max_prefill, "max_decode": settings.max_decode,
            "min": settings.min_replicas, "slo_ttft_s": cfg.ttft_slo_s,
            "slo_tpot_s": cfg.tpot_slo_s, "seed": args.seed}
    write_autoscale_report(out, summary, meta)
    print(autoscale_table(summary) + f"\nwrote {out / 'report.md'} (summary.json and "
          "replicas.png beside it)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
