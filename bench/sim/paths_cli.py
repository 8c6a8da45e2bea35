"""``pdserve sim paths``: adaptive disaggregation against aggregated and static P/D fleets.

    pdserve sim paths [--instances 16] [--seeds 0,1,2] [--workloads prefill_heavy,...]
                      [--fleets adaptive,aggregated,pd1:3,...] [--calibration PROFILE.json]
                      [--chunk-tokens 2048] [--point-s 60] [--real GOODPUT.json] [--out DIR]

For each workload (:mod:`bench.sim.path_workloads`) and fleet (:mod:`bench.sim.fleet`), the
highest request rate with >= 90 % of requests within both SLOs, mean over the seeds; prints
the table (and adaptive's ratio to the best other fleet) and the ranking per workload, and with
``--out`` writes ``DIR/paths.json`` (every seed's capacity) and ``DIR/paths.md``. Costs are
:class:`router.policy.path_cost.PathCosts`' defaults (a CPU box) unless ``--calibration``
names an instance profile. ``bench:<name>`` workloads are the goodput benchmark's own
(:mod:`bench.sim.bench_workloads`: the requests a ``python -m bench.pd_goodput --point-s S``
rate point replays); ``--real`` reads that benchmark's ``goodput.json`` and prints how far the
simulated ranking of its setups agrees with the measured one. Bad arguments: a message on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.sim.bench_workloads import bench_workloads
from bench.sim.fleet import FLEETS, FleetSettings
from bench.sim.path_workloads import WORKLOADS, SimWorkload
from bench.sim.paths import CompareConfig, compare, profile_settings
from bench.sim.report import paths_ranking, paths_table, ranking_agreement, real_capacities
from router.autoscale.profile import InstanceProfile
from router.errors import ConfigError

logger = logging.getLogger(__name__)


def _names(text: str, allowed: list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown) or '(none given)'}; allowed: "
                         f"{', '.join(allowed)}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve sim paths", description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=16, help="engines per fleet (default 16)")
    p.add_argument("--seeds", default="0,1,2", help="trace seeds (default 0,1,2)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, from: {', '.join(WORKLOADS)} and the goodput "
                        f"benchmark's {', '.join(bench_workloads())} (default: the former)")
    p.add_argument("--fleets", default=",".join(FLEETS),
                   help=f"comma-separated, from: {', '.join(FLEETS)} (default all)")
    p.add_argument("--calibration", default=None,
                   help="instance profile JSON (`pdserve bench profile` writes one)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill tokens per engine iteration (default 2048, or the profile's "
                        "max_batch_tokens)")
    p.add_argument("--point-s", type=float, default=60.0,
                   help="wall seconds of a bench: workload's rate point (as bench.pd_goodput's)")
    p.add_argument("--real", default=None,
                   help="bench.pd_goodput's goodput.json: print the ranking agreement")
    p.add_argument("--out", default=None, help="directory for paths.json and paths.md")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    # progress goes to stderr as INFO lines; `pdserve sim` runs this before `pdserve` configures
    # logging, and a run of many minutes with no line is indistinguishable from a hung one
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        known: dict[str, SimWorkload] = {**WORKLOADS, **bench_workloads(args.point_s)}
        workloads = [known[n] for n in _names(args.workloads, list(known), "workload")]
        real = real_capacities(json.loads(Path(args.real).read_text())) if args.real else {}
        fleets = _names(args.fleets, list(FLEETS), "fleet")
        seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
        settings = (profile_settings(InstanceProfile.load(args.calibration))
                    if args.calibration else FleetSettings(1.0, 0.05))
        if args.chunk_tokens is not None:
            settings = replace(settings, chunk_tokens=args.chunk_tokens)
        cfg = CompareConfig(args.instances, seeds, settings)
        if args.instances < 2 or not seeds or settings.chunk_tokens < 1:
            raise ValueError("--instances must be >= 2, --seeds non-empty, --chunk-tokens >= 1")
    except (ValueError, ConfigError, OSError) as exc:
        print(f"pdserve sim paths: error: {exc}", file=sys.stderr)
        return 2
    rows = compare(workloads, fleets, cfg, progress=logger.info)
    text = (f"N = {cfg.instances} engines per fleet, seeds {', '.join(map(str, seeds))}; "
            "capacity = highest req/s with >= 90 % within both SLOs (mean over seeds)\n\n"
            + paths_table(rows) + "\n" + paths_ranking(rows))
    if real:
        text += ("\nagainst the measured table (" + str(args.real) + "):\n\n"
                 + (ranking_agreement(rows, real) or "no workload in both\n"))
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "paths.json").write_text(json.dumps(
            {"instances": cfg.instances, "seeds": list(seeds), "costs": asdict(settings.costs),
             "chunk_tokens": settings.chunk_tokens,
             "slos": {w.name: [w.ttft_slo_s, w.tpot_slo_s] for w in workloads},
             "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
        (out / "paths.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
