"""DualMap against every baseline over a family of trace shapes nobody tuned it on.

    python -m bench.routing_quality [--shapes all] [--seeds 2] [--first-seed 4] [--requests 3000]
                                    [--instances 16] [--ttft-slo-s 2] [--jobs 2] [--json PATH]
                                    [--policies all]

Each shape is a synthetic BurstGPT-shaped trace (``bench.synth.gamma_rows``) under a
prefix-sharing model (``bench.sim.workload.WorkloadConfig``) that varies one thing from the
default: how much of the traffic is conversations, how many shared system prompts there are and
how popular the top ones are, one hot prefix, burstiness, prompt length. For every shape and
seed the simulator (which places through the router's own placement object) finds each
policy's effective capacity: the highest rate at which 90 % of requests meet the TTFT SLO, on
``--instances`` prefill and as many decode instances. The table prints, per shape and seed,
DualMap's capacity over the best baseline's (``router.policy.registry.BASELINES``) and over the
best peer's (``PEERS``: the field's routers, :mod:`router.policy.peers`), and which ones those
were. ``--policies`` runs a subset (names, or ``baselines`` / ``peers``; DualMap always runs) to
keep a run short.

DualMap's knobs were set on the ``default`` shape (the trace it was built with), and its SLO
switch point (``switch_fraction``) was chosen looking at seeds 0-3 of every shape. A row is held
out when neither applies: a shape other than ``default`` at seed 4 or above (the default
``--first-seed``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.sim.sweep import SweepConfig, effective_capacity, reuse_ceiling, starting_rate
from bench.sim.workload import SimRequest, WorkloadConfig, build_requests
from bench.synth import gamma_rows
from bench.trace import TraceRow, native_rate
from router.policy.registry import BASELINES, PEERS, PREFILL_POLICIES

#: shape -> (gamma_rows keyword arguments, WorkloadConfig changes)
SHAPES: dict[str, tuple[dict[str, float], dict[str, Any]]] = {
    "default": ({}, {}),
    "api-heavy": ({"conversation_share": 0.2}, {}),
    "few-prefixes": ({}, {"system_prompts": 8}),
    "many-flat-prefixes": ({}, {"system_prompts": 2000, "zipf_s": 0.6}),
    "hot-prefix": ({}, {"hot_share": 0.5}),
    "very-bursty": ({"burstiness": 0.15}, {}),
    "smooth": ({"burstiness": 4.0}, {}),
    "long-prompts": ({}, {"system_min_tokens": 3072, "system_max_tokens": 8192}),
}
TUNED = ("default",)
"""Shapes DualMap's parameters were chosen on."""
TUNED_SEEDS = 4
"""Seeds below this were looked at when choosing DualMap's switch point."""
REFERENCE = "dualmap"
GROUPS = {"baselines": BASELINES, "peers": PEERS}
"""The groups DualMap's capacity is compared with, each by its best member."""


def policy_names(spec: str) -> list[str]:
    """``--policies``: ``all``, or comma-separated names and group names; DualMap first.
    A KeyError names the first unknown one."""
    names: list[str] = [REFERENCE]
    for part in (list(PREFILL_POLICIES) if spec == "all" else spec.split(",")):
        part = part.strip()
        if part in GROUPS:
            names.extend(GROUPS[part])
        elif part in PREFILL_POLICIES:
            names.append(part)
        elif part:
            raise KeyError(part)
    return list(dict.fromkeys(names))


def held_out(shape: str, seed: int) -> bool:
    """Whether DualMap's tuning never looked at ``shape`` with ``seed``."""
    return shape not in TUNED and seed >= TUNED_SEEDS


def _ratio(reference: float, best: float) -> float:
    return reference / best if best else float("inf")


def shape_requests(shape: str, seed: int, n: int, block_tokens: int
                   ) -> tuple[list[TraceRow], list[SimRequest]]:
    """The trace rows and the simulator's requests of ``n`` arrivals of ``shape``."""
    rows_kw, workload_kw = SHAPES[shape]
    rows = gamma_rows(n, seed=seed, **rows_kw)  # type: ignore[arg-type]
    workload = replace(WorkloadConfig(block_tokens=block_tokens), **workload_kw)
    return rows, build_requests(rows, workload, seed)


def one(shape: str, seed: int, n: int, instances: int, ttft_slo_s: float,
        policies: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The effective capacity of every policy (or of ``policies``, which must include DualMap)
    on one shape and seed. ``best_baseline`` / ``dualmap_over_best`` compare DualMap with the
    best of all the others run; ``groups`` with the best of each group (baselines, peers)."""
    cfg = SweepConfig(instances, instances, ttft_slo_s, 0.1)
    rows, reqs = shape_requests(shape, seed, n, cfg.prefill.block_tokens)
    native = native_rate(rows)
    mean_prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
    start = starting_rate(reqs, cfg)
    ceiling = reuse_ceiling(reqs, cfg)
    started = time.monotonic()
    caps = {name: effective_capacity(name, reqs, cfg, native, start)[0]
            for name in (policies or tuple(PREFILL_POLICIES))}
    base = {k: v for k, v in caps.items() if k != REFERENCE}
    best = max(base, key=lambda k: base[k])
    groups = {}
    for group, members in GROUPS.items():
        run = [m for m in members if m in caps]
        if run:
            top = max(run, key=lambda k: caps[k])
            groups[group] = {"best": top, "dualmap_over": _ratio(caps[REFERENCE], caps[top]),
                             "ceiling_over": _ratio(ceiling, caps[top])}
    return {"shape": shape, "seed": seed, "held_out": held_out(shape, seed),
            "mean_prompt_tokens": round(mean_prompt), "capacity_rps": caps,
            "ceiling_rps": ceiling,
            "best_baseline": best, "dualmap_over_best": _ratio(caps[REFERENCE], base[best]),
            "groups": groups, "seconds": round(time.monotonic() - started, 1)}


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """One line per shape and seed (DualMap over the best baseline and over the best peer,
    and the reuse ceiling over each), then the held-out and tuned summaries per group."""
    names = list(rows[0]["capacity_rps"]) if rows else []
    groups = [g for g in GROUPS if rows and g in rows[0]["groups"]]
    short = {"baselines": "base", "peers": "peer"}
    print(f"# {args.instances}+{args.instances} instances, {args.requests} requests per trace, "
          f"TTFT SLO {args.ttft_slo_s:g} s, effective capacity (req/s at 90 % within the SLO); "
          f"ceiling: every reusable prefix found, work spread perfectly "
          f"(bench.sim.sweep.reuse_ceiling); load {os.getloadavg()[0]:.2f}")
    print(f"{'shape':<19}{'seed':>4}{'held':>5}{'prompt':>7} "
          + " ".join(f"{n[:11]:>11}" for n in names) + f" {'ceiling':>8}"
          + "".join(f" {'DM/' + short[g]:>8} {'ceil/' + short[g]:>9}" for g in groups)
          + "".join(f" {'best ' + g[:-1]:<18}" for g in groups))
    for r in rows:
        caps = r["capacity_rps"]
        print(f"{r['shape']:<19}{r['seed']:>4}{'yes' if r['held_out'] else 'no':>5}"
              f"{r['mean_prompt_tokens']:>7} "
              + " ".join(f"{caps[n]:>11.2f}" for n in names) + f" {r['ceiling_rps']:>8.1f}"
              + "".join(f" {r['groups'][g]['dualmap_over']:>7.2f}x"
                        f" {r['groups'][g]['ceiling_over']:>8.2f}x" for g in groups)
              + "".join(f" {r['groups'][g]['best']:<18}" for g in groups))
    for label, subset in (("held out", [r for r in rows if r["held_out"]]),
                          ("tuned", [r for r in rows if not r["held_out"]])):
        for g in groups:
            if subset:
                ratios = [r["groups"][g]["dualmap_over"] for r in subset]
                room = [r["groups"][g]["ceiling_over"] for r in subset]
                behind = sum(x < 1.0 for x in ratios)
                print(f"{label}: DualMap / best {g[:-1]} geometric mean "
                      f"{statistics.geometric_mean(ratios):.2f}x, min {min(ratios):.2f}x, "
                      f"behind on {behind} of {len(ratios)}; the ceiling / best {g[:-1]} "
                      f"{statistics.geometric_mean(room):.2f}x (min {min(room):.2f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_quality",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all",
                    help=f"comma-separated, or all: {', '.join(SHAPES)}")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=TUNED_SEEDS)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--ttft-slo-s", type=float, default=2.0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--policies", default="all",
                    help="comma-separated policy names or groups (baselines, peers), or all; "
                         f"from: {', '.join(PREFILL_POLICIES)}")
    args = ap.parse_args(argv)
    shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if (unknown or args.seeds < 1 or args.first_seed < 0 or args.requests < 100
            or args.instances < 1):
        print(f"{ap.prog}: unknown shape {unknown} or --seeds/--first-seed/--requests/--instances "
              "out of range",
              file=sys.stderr)
        return 2
    try:
        policies = tuple(policy_names(args.policies))
    except KeyError as exc:
        print(f"{ap.prog}: unknown policy {exc.args[0]!r}; allowed: "
              f"{', '.join([*PREFILL_POLICIES, *GROUPS])}", file=sys.stderr)
        return 2
    if len(policies) < 2:
        print(f"{ap.prog}: --policies needs at least one policy besides {REFERENCE}",
              file=sys.stderr)
        return 2
    work = [(s, seed, args.requests, args.instances, args.ttft_slo_s, policies)
            for s in shapes for seed in range(args.first_seed, args.first_seed + args.seeds)]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, *zip(*work, strict=True)))
    print_table(rows, args)
    if args.json:
        doc = {"tuned": TUNED, "tuned_seeds": TUNED_SEEDS, "policies": policies,
               "groups": {g: [m for m in GROUPS[g] if m in policies] for g in GROUPS},
               "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
