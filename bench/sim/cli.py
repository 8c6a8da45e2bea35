"""``pdserve sim``: compare prefill placement policies on a BurstGPT trace in simulation.

    pdserve sim --trace FILE.csv --prefill N --decode M --policies dualmap,round_robin,...
                --slo-ttft SECONDS --slo-tpot SECONDS --out DIR [--seed S]

Writes ``DIR/summary.json`` (policy -> effective_capacity_rps, ttft_p50, ttft_p99,
slo_attainment, cache_hit_ratio, load_max_over_mean, ...), ``DIR/report.md`` and PNG plots.
Unknown policy, bad trace or bad numbers: a message on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from bench.sim.perf import DecodePerf, PrefillPerf, load_calibration
from bench.sim.report import write_report, write_summary
from bench.sim.sweep import SweepConfig, effective_capacity, run_at, summarize
from bench.sim.trace_input import TraceError, native_rate, read_trace
from bench.sim.workload import WorkloadConfig, build_requests
from router.policy.registry import BASELINES, PREFILL_POLICIES

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="BurstGPT-format CSV")
    p.add_argument("--prefill", type=int, required=True, help="prefill instances")
    p.add_argument("--decode", type=int, required=True, help="decode instances")
    p.add_argument("--policies", required=True,
                   help=f"comma-separated, from: {', '.join(PREFILL_POLICIES)}")
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT SLO (s)")
    p.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO (s)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="prefix-model seed (default 0)")
    p.add_argument("--limit", type=int, default=None, help="use the first N trace rows")
    p.add_argument("--calibration", default=None, help="measured perf profile (JSON)")
    p.add_argument("--hot-share", type=float, default=0.0,
                   help="share of requests on one system prompt (default 0)")
    p.add_argument("--no-rebalance", action="store_true", help="disable DualMap rebalancing")
    return p


def _fail(msg: str) -> int:
    print(f"pdserve sim: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in PREFILL_POLICIES]
    if not names or unknown:
        return _fail(f"unknown policy {', '.join(unknown) or '(none given)'}; allowed: "
                     f"{', '.join(sorted(PREFILL_POLICIES))}")
    if args.prefill < 1 or args.decode < 1 or args.slo_ttft <= 0 or args.slo_tpot <= 0:
        return _fail("--prefill and --decode must be >= 1 and the SLOs > 0")
    try:
        rows = read_trace(args.trace, args.limit)
    except TraceError as exc:
        return _fail(str(exc))
    if len(rows) < 10:
        return _fail(f"{args.trace} has only {len(rows)} usable rows (need >= 10)")
    prefill, decode = PrefillPerf(), DecodePerf()
    if args.calibration:
        try:
            prefill, decode = load_calibration(args.calibration)
        except (OSError, ValueError, TypeError) as exc:
            return _fail(f"bad calibration {args.calibration}: {exc}")
    cfg = SweepConfig(args.prefill, args.decode, args.slo_ttft, args.slo_tpot, prefill, decode,
                      rebalance=not args.no_rebalance)
    reqs = build_requests(rows, WorkloadConfig(hot_share=args.hot_share,
                                               block_tokens=prefill.block_tokens), args.seed)
    native = native_rate(rows)
    # a starting guess: all prefill capacity busy on a mean prompt with no cache reuse
    mean_prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
    start = args.prefill / (prefill.overhead_s + mean_prompt * prefill.per_token_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
            "n_decode": args.decode, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
            "seed": args.seed, "reference_rps": reference}
    write_summary(out, summary)
    write_report(out, summary, meta, curves, ttfts, loads)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(main())
