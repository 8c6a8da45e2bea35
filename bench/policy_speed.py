"""Routing decision speed: decisions/s and p50/p99 latency of ``select`` at 16/256/1000 instances.

    python -m bench.policy_speed [--policies dualmap,...] [--decisions 20000]

Each decision routes a 2,048-token prompt (128 blocks, hashed beforehand as the router does once
per request) drawn from 500 sessions over a 200-prompt Zipf system-prompt mix, against a
:class:`~router.policy.base.CandidatePool` snapshot (indexed once per snapshot, as the router's
tracker would); the dispatch is then observed so the cache model and hot-prefix detector stay warm.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.metrics import percentile
from router import settings as shared
from router.policy.base import Candidate, CandidatePool, Dispatched, Membership, RouteRequest
from router.policy.hashing import hash_int
from router.policy.registry import create_prefill_policy


def measure(name: str, n_instances: int, decisions: int, seed: int = 0) -> dict[str, float]:
    """Latency percentiles (microseconds) and decisions/s of ``select``."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(n_instances)]
    policy = create_prefill_policy(name)
    policy.observe(Membership("m", tuple(workers)))
    pool = CandidatePool([Candidate(w, in_flight=rng.randint(0, 8),
                                    pending_prefill_tokens=rng.randint(0, 20_000))
                          for w in workers])
    weights = [1 / (k + 1) ** 1.1 for k in range(200)]
    reqs = []
    for i in range(decisions):
        sysp = rng.choices(range(200), weights)[0]
        sess = rng.randrange(500)
        hashes = tuple(hash_int(sysp * 1000 + b, 1) if b < 64 else
                       hash_int(sess * 100_000 + b, 2) for b in range(128))
        reqs.append(RouteRequest(str(i), "m", block_hashes=hashes, num_prompt_tokens=2048))
    lat = []
    for req in reqs:
        t0 = time.perf_counter_ns()
        choice = policy.select(req, pool)
        lat.append(time.perf_counter_ns() - t0)
        assert choice is not None
        policy.observe(Dispatched(req.request_id, choice.worker_id, "m", req))
    return {"p50_us": percentile(lat, 50) / 1e3, "p99_us": percentile(lat, 99) / 1e3,
            "decisions_per_s": 1e9 / statistics.fmean(lat)}


def main(argv: list[str] | None = None) -> int:
    """Print a markdown table."""
    p = argparse.ArgumentParser(prog="python -m bench.policy_speed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=shared.default("policy"))
    p.add_argument("--instances", default="16,256,1000")
    p.add_argument("--decisions", type=int, default=20_000)
    args = p.parse_args(argv)
    print("| policy | instances | p50 (us) | p99 (us) | decisions/s |")
    print("|---|---|---|---|---|")
    for name in args.policies.split(","):
        for n in (int(x) for x in args.instances.split(",")):
            m = measure(name, n, args.decisions)
            print(f"| {name} | {n} | {m['p50_us']:.1f} | {m['p99_us']:.1f} | "
                  f"{m['decisions_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
