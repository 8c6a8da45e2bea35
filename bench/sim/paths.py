"""Capacity of each fleet on each workload: adaptive disaggregation against static fleets.

A fleet's capacity on a workload is the highest arrival rate at which >= ``target`` (90 %) of
the measured requests meet both SLOs (TTFT and TPOT), found by doubling or halving from a
first guess, then ``bisect_steps`` (5) bisections (within ~3 %; :func:`bench.sim.sweep.
highest_rate`). Each seed is its own trace; the table holds the mean over seeds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from bench.sim.fleet import FleetResult, FleetSettings, make_fleet, simulate_fleet
from bench.sim.path_workloads import SimWorkload
from bench.sim.sweep import highest_rate
from router.autoscale.profile import InstanceProfile
from router.policy.path_cost import PathCosts


def profile_settings(profile: InstanceProfile, ttft_slo_s: float = 1.0,
                     tpot_slo_s: float = 0.05) -> FleetSettings:
    """Fleet settings from the simulator's instance profile (``--calibration``): its prefill
    line, its decode step line (a step of one sequence = ``step_s + per_seq_s``), its KV
    transfer per token, batch budget and cache; the P/D hop keeps its default."""
    pp, dp = profile.prefill, profile.decode
    costs = PathCosts(prefill_s_per_token=pp.per_token_s, prefill_fixed_s=pp.overhead_s,
                      prefill_s_per_token_sq=pp.per_token_sq_s,
                      decode_step_s=dp.step_s + dp.per_seq_s, decode_step_s_per_seq=dp.per_seq_s,
                      pull_s_per_token=dp.kv_transfer_s_per_token)
    return FleetSettings(ttft_slo_s, tpot_slo_s, costs, chunk_tokens=pp.max_batch_tokens,
                         cache_blocks=pp.cache_blocks, block_tokens=pp.block_tokens)


@dataclass(frozen=True)
class Capacity:
    """One fleet's capacity on one workload and trace seed, and its run at that rate."""

    rate_rps: float
    at_capacity: FleetResult | None
    """The run at ``rate_rps`` (None: no rate passed)."""


@dataclass(frozen=True)
class CompareConfig:
    """What a comparison holds fixed."""

    instances: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    settings: FleetSettings = field(default_factory=lambda: FleetSettings(1.0, 0.05))
    """Costs, chunking and cache; each workload's SLOs replace the SLOs here."""
    target: float = 0.9
    bisect_steps: int = 5


def capacity(workload: SimWorkload, fleet_name: str, seed: int, cfg: CompareConfig,
             start_rps: float) -> Capacity:
    """The highest rate at which ``fleet_name`` keeps ``cfg.target`` within both SLOs."""
    fleet = make_fleet(fleet_name, cfg.instances)
    settings = replace(cfg.settings, ttft_slo_s=workload.ttft_slo_s,
                       tpot_slo_s=workload.tpot_slo_s)
    passed: dict[float, FleetResult] = {}

    def ok(rate: float) -> bool:
        res = simulate_fleet(workload.requests(rate, seed), fleet, settings,
                             give_up_below=cfg.target)
        good = res.stopped_s is None and \
            res.attainment(workload.ttft_slo_s, workload.tpot_slo_s) >= cfg.target
        if good:
            passed[rate] = res
        return good

    rate = highest_rate(ok, start_rps, cfg.bisect_steps)
    return Capacity(rate, passed.get(rate))


def first_guess(workload: SimWorkload, cfg: CompareConfig) -> float:
    """Half of what the fleet could prefill with no decoding at all (req/s)."""
    sample = workload.requests(1.0, 0)
    mean_prompt = statistics.fmean(r.prompt_tokens for r in sample)
    return 0.5 * cfg.instances / cfg.settings.costs.prefill_s(round(mean_prompt))


@dataclass(frozen=True)
class Row:
    """One workload: per fleet the capacity of each seed, and adaptive's P/D share there."""

    workload: str
    capacity_rps: dict[str, list[float]]
    adaptive_pd_share: list[float]


def compare(workloads: Sequence[SimWorkload], fleets: Sequence[str], cfg: CompareConfig,
            progress: Callable[[str], None] | None = None) -> list[Row]:
    """Every fleet's capacity on every workload for every seed."""
    rows = []
    for w in workloads:
        caps: dict[str, list[float]] = {f: [] for f in fleets}
        pd_share: list[float] = []
        for seed in cfg.seeds:
            guess = first_guess(w, cfg)
            for f in fleets:
                cap = capacity(w, f, seed, cfg, guess)
                caps[f].append(cap.rate_rps)
                guess = cap.rate_rps or guess
                if f == "adaptive" and cap.at_capacity is not None:
                    paths = cap.at_capacity.paths
                    pd_share.append(paths["pd"] / max(sum(paths.values()), 1))
                if progress:
                    progress(f"{w.name} seed {seed} {f}: {cap.rate_rps:.1f} req/s")
        rows.append(Row(w.name, caps, pd_share))
    return rows
