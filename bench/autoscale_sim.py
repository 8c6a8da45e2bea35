"""Autoscaling in simulation: the SLO planner vs an HPA-style threshold autoscaler vs a static
pool sized for the peak, on a bursty BurstGPT-shaped trace whose rate varies 10x.

    python -m bench.autoscale_sim [--duration-s 3600] [--peak-rps 80] [--policy dualmap]
                                  [--out DIR]

The trace: gamma inter-arrivals (shape 0.5, BurstGPT's burstiness) at a rate that follows
:data:`SHAPE` (relative rate over the run, 0.1 .. 1.0) times ``--peak-rps``; lengths and
sessions as in ``bench.sim.trace_input.synth_rows``. The static-peak pool is the smallest
fixed (prefill, decode) pool with >= 95 % of requests within both SLOs on the whole trace
(searched: decode shrunk with prefill at the maximum, then prefill shrunk). The autoscalers
start from 1 + 1 with that pool (x ``--headroom``) as their maximum, a ``--start-delay-s``
worker start and a 10 s interval. Prints one table row per autoscaler: SLO attainment (both
SLOs), billed instance-seconds, ratio vs the static-peak pool, replicas max.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.sim.autoscale import (
    AutoscaleSettings,
    arrival_rate,
    autoscale_summary,
    make_controller,
    plot_replicas,
)
from bench.sim.engine import RunResult, simulate
from bench.sim.perf import DecodePerf, PrefillPerf
from bench.sim.sweep import SweepConfig, make_policy
from bench.sim.trace_input import iter_varying_rows
from bench.sim.workload import SimRequest, WorkloadConfig, build_requests

logger = logging.getLogger(__name__)

#: relative arrival rate at fractions of the run: a quiet start, a slow ramp to the peak, a
#: decline, a sudden burst (1 minute rise), and a quiet tail; min/max = 0.1
SHAPE: tuple[tuple[float, float], ...] = (
    (0.0, 0.1), (0.08, 0.1), (0.25, 1.0), (0.35, 1.0), (0.45, 0.3), (0.55, 0.15),
    (0.6, 0.15), (0.617, 1.0), (0.7, 0.8), (0.78, 0.2), (0.9, 0.1), (1.0, 0.1))

TARGET = 0.95


#: a gentler shape for short runs (the small-config test): one 30 % ramp up and down
RAMP: tuple[tuple[float, float], ...] = (
    (0.0, 0.1), (0.15, 0.1), (0.45, 1.0), (0.6, 1.0), (0.85, 0.1), (1.0, 0.1))


def make_trace(duration_s: float, peak_rps: float, seed: int,
               shape: Sequence[tuple[float, float]] = SHAPE) -> list[SimRequest]:
    """The bursty trace as simulator requests."""
    knots = [(f * duration_s, r * peak_rps) for f, r in shape]
    rows = list(iter_varying_rows(knots, seed=seed))
    return build_requests(rows, WorkloadConfig(), seed)


def run(reqs: Sequence[SimRequest], policy: str, settings: AutoscaleSettings,
        ttft_slo_s: float, tpot_slo_s: float, prefill: PrefillPerf | None = None,
        decode: DecodePerf | None = None) -> RunResult:
    """One replay with pools sized by ``settings``."""
    pp, dp = prefill or PrefillPerf(), decode or DecodePerf()
    cfg = SweepConfig(settings.max_prefill, settings.max_decode, ttft_slo_s, tpot_slo_s, pp, dp)
    ctx = statistics.fmean(r.prompt_tokens for r in reqs)
    controller = make_controller(settings, ttft_slo_s, tpot_slo_s, pp, dp, ctx)
    return simulate(reqs, make_policy(policy, cfg), settings.max_prefill, settings.max_decode,
                    pp, dp, rebalance_threshold_s=ttft_slo_s if policy == "dualmap" else None,
                    controller=controller, start_delay_s=settings.start_delay_s)


def _attainment(res: RunResult, ttft_slo_s: float, tpot_slo_s: float) -> float:
    return float(autoscale_summary(res, ttft_slo_s, tpot_slo_s)["slo_attainment"])


def static_peak(reqs: Sequence[SimRequest], policy: str, ttft_slo_s: float, tpot_slo_s: float,
                max_prefill: int, max_decode: int) -> tuple[int, int, RunResult]:
    """The smallest static (prefill, decode) pool meeting the target on the whole trace:
    decode shrunk with prefill at its maximum, then prefill shrunk with that decode pool."""
    runs: dict[tuple[int, int], tuple[bool, RunResult]] = {}

    def ok(p: int, d: int) -> bool:
        if (p, d) not in runs:
            res = run(reqs, policy, AutoscaleSettings("static", p, d), ttft_slo_s, tpot_slo_s)
            att = _attainment(res, ttft_slo_s, tpot_slo_s)
            logger.info("static %d+%d -> %.4f", p, d, att)
            runs[p, d] = (att >= TARGET, res)
        return runs[p, d][0]

    def smallest(hi: int, good: Callable[[int], bool]) -> int:
        # downward from a pool that meets the target: a badly overloaded probe (a bisection's
        # midpoint) would take long to simulate, its queues grow without bound
        if not good(hi):
            raise RuntimeError(f"even {hi} instances miss the target; raise the maximum")
        while hi > 1 and good(hi - 1):
            hi -= 1
        return hi

    d = smallest(max_decode, lambda d: ok(max_prefill, d))
    p = smallest(max_prefill, lambda p: ok(p, d))
    return p, d, runs[p, d][1]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, print the table, write ``DIR/summary.json`` and the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--peak-rps", type=float, default=80.0)
    ap.add_argument("--policy", default="dualmap")
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--slo-tpot", type=float, default=0.05)
    ap.add_argument("--start-delay-s", type=float, default=30.0)
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--headroom", type=float, default=1.5,
                    help="autoscalers' maximum = static-peak pool x this (default 1.5)")
    ap.add_argument("--profile-bias", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--static", default=None,
                    help="static-peak pool as P+D (default: search for the smallest)")
    ap.add_argument("--search-max-prefill", type=int, default=16)
    ap.add_argument("--search-max-decode", type=int, default=8)
    ap.add_argument("--out", default=None, help="write summary.json and replicas.png here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    t0 = time.perf_counter()
    reqs = make_trace(args.duration_s, args.peak_rps, args.seed)
    logger.info("%d requests over %.0f s (mean %.1f req/s, peak %.0f req/s)", len(reqs),
                args.duration_s, len(reqs) / args.duration_s, args.peak_rps)
    if args.static:
        sp, sd = (int(x) for x in args.static.split("+"))
        static_res = run(reqs, args.policy, AutoscaleSettings("static", sp, sd), args.slo_ttft,
                         args.slo_tpot)
    else:
        sp, sd, static_res = static_peak(reqs, args.policy, args.slo_ttft, args.slo_tpot,
                                         args.search_max_prefill, args.search_max_decode)
    runs: dict[str, RunResult] = {f"static-peak ({sp}+{sd})": static_res}
    mp, md = math.ceil(sp * args.headroom), math.ceil(sd * args.headroom)
    for mode in ("planner", "threshold"):
        settings = AutoscaleSettings(mode, mp, md, interval_s=args.interval_s,
                                     start_delay_s=args.start_delay_s,
                                     profile_bias=args.profile_bias)
        runs[mode] = run(reqs, args.policy, settings, args.slo_ttft, args.slo_tpot)
    summary: dict[str, dict[str, Any]] = {
        name: autoscale_summary(res, args.slo_ttft, args.slo_tpot) for name, res in runs.items()}
    base = summary[next(iter(summary))]["instance_seconds"]["total"]
    print(f"trace: {len(reqs)} requests, {args.duration_s:.0f} s, rate "
          f"{0.1 * args.peak_rps:.0f}..{args.peak_rps:.0f} req/s; policy {args.policy}; "
          f"SLOs TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s; start delay "
          f"{args.start_delay_s:.0f} s; autoscaler max {mp}+{md}")
    print(f"{'autoscaler':<22} {'SLO att.':>8} {'TTFT att.':>9} {'TPOT att.':>9} "
          f"{'inst-s':>9} {'vs static':>9} {'max P+D':>8} {'mean P+D':>10}")
    for name, m in summary.items():
        m["instance_seconds_vs_static_peak"] = m["instance_seconds"]["total"] / base
        print(f"{name:<22} {m['slo_attainment']:>8.4f} {m['slo_attainment_ttft']:>9.4f} "
              f"{m['slo_attainment_tpot']:>9.4f} {m['instance_seconds']['total']:>9.0f} "
              f"{m['instance_seconds_vs_static_peak']:>9.3f} "
              f"{m['replicas_max']['prefill']:>4}+{m['replicas_max']['decode']:<3} "
              f"{m['replicas_mean']['prefill']:>5.2f}+{m['replicas_mean']['decode']:.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        plot_replicas(out / "replicas.png", runs,
                      arrival_rate([r.arrival_s for r in reqs]))
    logger.info("done in %.0f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
