"""Simulator scale benchmark: replay 1 M requests on 1,000 prefill instances with DualMap.

    python -m bench.sim_scale [--requests 1000000] [--prefill 1000] [--decode 1000]

The trace is synthesized lazily (BurstGPT-shaped, sessions left to the prefix model) at an
arrival rate of ``--rate`` (default 3 req/s per prefill instance), so memory stays flat; prints
wall time, simulated time, events per second and the run's SLO attainment.
"""

from __future__ import annotations

import argparse
import time

from bench.sim.engine import simulate
from bench.sim.sweep import attainment
from bench.sim.workload import WorkloadConfig, iter_requests
from bench.synth import iter_gamma_rows
from router import settings as shared
from router.policy.context import PolicyContext
from router.policy.registry import create_prefill_policy


def main(argv: list[str] | None = None) -> int:
    """Run once and print the numbers."""
    p = argparse.ArgumentParser(prog="python -m bench.sim_scale",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--prefill", type=int, default=1000)
    p.add_argument("--decode", type=int, default=1000)
    p.add_argument("--rate", type=float, default=None, help="req/s (default 3 x prefill)")
    p.add_argument("--policy", default=shared.default("policy"))
    p.add_argument("--slo-ttft", type=float, default=2.0)
    args = p.parse_args(argv)
    rate = args.rate or 3.0 * args.prefill
    rows = iter_gamma_rows(args.requests, rate_rps=rate, seed=0, session_ids=False)
    reqs = iter_requests(rows, WorkloadConfig(open_sessions=20 * args.prefill), seed=0)
    policy = create_prefill_policy(args.policy, PolicyContext(ttft_slo_s=args.slo_ttft))
    t0 = time.perf_counter()
    res = simulate(reqs, policy, args.prefill, args.decode, rebalance_threshold_s=args.slo_ttft)
    wall = time.perf_counter() - t0
    print(f"requests={args.requests} prefill={args.prefill} decode={args.decode} "
          f"rate={rate:.0f}/s policy={args.policy}")
    print(f"wall={wall:.1f}s simulated={res.sim_end_s:.1f}s "
          f"requests_per_wall_s={args.requests / wall:.0f} "
          f"slo_attainment={attainment(res, args.slo_ttft):.3f} "
          f"cache_hit_ratio={res.cached_tokens / max(res.prompt_tokens, 1):.3f} "
          f"migrations={res.migrations}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
