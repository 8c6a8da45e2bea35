"""Rate sweep: effective request capacity = the highest arrival rate at which >= 90 % of
requests meet the TTFT SLO (DualMap's metric; DistServe's goodput with TTFT only).

The same requests are replayed with arrival times scaled; the search doubles the rate until the
SLO attainment drops under the target, then bisects ``bisect_steps`` (7) times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.metrics import percentile
from bench.sim.engine import RunResult, simulate
from bench.sim.workload import SimRequest
from router.autoscale.profile import DecodePerf, PrefillPerf
from router.policy.base import PlacementPolicy
from router.policy.cache_model import leading_present
from router.policy.context import PolicyContext
from router.policy.registry import create_prefill_policy


@dataclass(frozen=True)
class SweepConfig:
    """What one comparison holds fixed."""

    n_prefill: int
    n_decode: int
    ttft_slo_s: float
    tpot_slo_s: float
    prefill: PrefillPerf = field(default_factory=PrefillPerf)
    decode: DecodePerf = field(default_factory=DecodePerf)
    target_attainment: float = 0.9
    warmup_fraction: float = 0.1
    bisect_steps: int = 7
    rebalance: bool = True


def policy_context(cfg: SweepConfig) -> PolicyContext:
    """What every policy may know: the TTFT SLO and the simulated prefill's cost and cache."""
    return PolicyContext(ttft_slo_s=cfg.ttft_slo_s, per_token_s=cfg.prefill.per_token_s,
                         block_tokens=cfg.prefill.block_tokens,
                         cache_capacity_blocks=cfg.prefill.cache_blocks)


def make_policy(name: str, cfg: SweepConfig) -> PlacementPolicy:
    """A fresh policy built by its factory from the run's :func:`policy_context`."""
    return create_prefill_policy(name, policy_context(cfg))


def run_at(name: str, reqs: Sequence[SimRequest], cfg: SweepConfig, rate_rps: float,
           native_rps: float) -> RunResult:
    """One run of ``name`` at ``rate_rps``."""
    threshold = cfg.ttft_slo_s if cfg.rebalance else None
    return simulate(reqs, make_policy(name, cfg), cfg.n_prefill, cfg.n_decode, cfg.prefill,
                    cfg.decode, rate_scale=native_rps / rate_rps,
                    rebalance_threshold_s=threshold,
                    warmup=int(len(reqs) * cfg.warmup_fraction))


def attainment(res: RunResult, slo_s: float) -> float:
    """Share of measured requests with TTFT within ``slo_s``."""
    return sum(t <= slo_s for t in res.ttft_s) / len(res.ttft_s) if res.ttft_s else 0.0


def starting_rate(reqs: Sequence[SimRequest], cfg: SweepConfig) -> float:
    """A first guess for :func:`effective_capacity`: every prefill instance busy on the mean
    prompt with no cache reuse (req/s)."""
    mean_prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
    return cfg.n_prefill / (cfg.prefill.overhead_s + mean_prompt * cfg.prefill.per_token_s)


def reuse_ceiling(reqs: Sequence[SimRequest], cfg: SweepConfig) -> float:
    """The arrival rate (req/s) at which the prefill instances would be exactly busy if every
    prompt reused the longest prefix any earlier prompt had (one unbounded cache, arrival
    order) and the work were spread perfectly, batch overheads left out: what no placement
    can sustain beyond. Over a short trace a policy can run above it for a while, by the
    backlog its SLO lets build up, so it bounds sustained throughput, not one trace's
    capacity. ``inf`` when nothing is left to compute."""
    seen: set[int] = set()
    busy_s = 0.0
    bt = cfg.prefill.block_tokens
    for r in reqs:
        # every hash ever seen stays: what it holds of a chain is a prefix of it
        cached = min(leading_present(r.block_hashes, seen) * bt, r.prompt_tokens)
        busy_s += ((r.prompt_tokens - cached) * cfg.prefill.per_token_s
                   + cached * cfg.prefill.cached_token_s)
        seen.update(r.block_hashes)
    return cfg.n_prefill * len(reqs) / busy_s if busy_s else float("inf")


def effective_capacity(name: str, reqs: Sequence[SimRequest], cfg: SweepConfig,
                       native_rps: float, start_rps: float,
                       progress: Callable[[str], None] | None = None
                       ) -> tuple[float, list[tuple[float, float]]]:
    """(capacity in req/s, [(rate, attainment)] of every point run)."""
    points: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        att = attainment(run_at(name, reqs, cfg, rate, native_rps), cfg.ttft_slo_s)
        points.append((rate, att))
        if progress:
            progress(f"{name} {rate:.2f} req/s -> {att:.3f}")
        return att >= cfg.target_attainment

    return highest_rate(ok, start_rps, cfg.bisect_steps), sorted(points)

def highest_rate(ok: Callable[[float], bool], start_rps: float, bisect_steps: int) -> float:
    """The highest rate with ``ok`` (assumed monotone): doubled from ``start_rps`` while it
    holds (or halved until it does), then ``bisect_steps`` bisections of the bracket (each
    halves it: 5 steps leave it within 1/32 of the answer). 0.0 when even ``start_rps``/2**20
    fails; ``start_rps`` x 2**20 when that still holds."""
    lo, hi = 0.0, start_rps
    for _ in range(20):
        if not ok(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return hi
    if lo == 0.0:
        for _ in range(20):
            hi_fail, lo = hi, hi / 2
            if ok(lo):
                hi = hi_fail
                break
            hi = lo
        else:
            return 0.0
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def summarize(res: RunResult, cfg: SweepConfig) -> dict[str, Any]:
    """The per-policy metrics of one run."""
    ttft, tpot = res.ttft_s, res.tpot_s
    tpot_p99 = percentile(tpot, 99, empty=0.0)
    busy = list(res.busy_s.values())
    mean_busy = statistics.fmean(busy) if busy else 0.0
    return {
        **{f"ttft_p{p}": percentile(ttft, p, empty=0.0) for p in (50, 90, 99)},
        "tpot_p50": percentile(tpot, 50, empty=0.0), "tpot_p99": tpot_p99,
        "slo_attainment": attainment(res, cfg.ttft_slo_s),
        "slo_attainment_ttft_tpot": (
            sum(1 for t in res.ttft_s if t <= cfg.ttft_slo_s) / len(res.ttft_s)
            if res.ttft_s and tpot_p99 <= cfg.tpot_slo_s else 0.0),
        "cache_hit_ratio": res.cached_tokens / res.prompt_tokens if res.prompt_tokens else 0.0,
        "load_max_over_mean": max(busy) / mean_busy if mean_busy else 0.0,
        "migrations": res.migrations,
    }
