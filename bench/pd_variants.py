"""Variants of a setup on the same requests, in rotated rounds, compared request by request.

    python -m bench.pd_variants --workload decode_heavy --rate 6 --rounds 3 \\
        --variant static=aggregated --variant-arg static=--router-arg=--path-policy=static \\
        --variant held=aggregated --variant-arg held=--router-arg=--path-policy=adaptive \\
        [--variant-tree held=DIR] [--point-s 60] [--warmup-requests 40] [--seed 2] [--out DIR]
    python -m bench.pd_variants --workload mix --rate 2.5 --rate 3 --rate 3.5 --rounds 2 \\
        --variant adaptive=adaptive --variant aggregated=aggregated     # a paired ladder

Where ``bench.pd_goodput`` asks how fast each setup goes, this asks whether one change
(a router flag, a worker argument) helps at one rate, on this box, beyond chance. Each variant is
a ``bench.pd_goodput`` setup plus ``pdserve up`` arguments (``--variant-arg NAME=ARG``,
repeatable). Every round starts, warms up, replays the rate point against and stops each
variant in turn, alone on the box, the order rotated by one each round; every run replays the
same requests (the same prompts at the same send times). The box's speed moves by tens of
percent within minutes (one engine's TPOT at 8 streams read 6.9 and 11.9 ms a minute apart),
so one run of each says little: rounds interleave the variants in time, and the report pools
them request by request (:mod:`bench.paired`): for each pair, the requests only one met (exact
McNemar p), the TTFT p99 difference with its 95 % interval, and the median paired TPOT
difference, per round and pooled. Records: ``DIR/NAME-ROUND/point/requests.csv``, and for a
setup behind pdserve's router its ``timeline.jsonl`` (the client names each request
``bench-INDEX``) and ``paths.json`` (the point's ``pdserve_router_paths_total``). Where the
router planned paths, the report adds the held requests and how far the plans' TPOT was off
(:func:`plan_line`).

With several ``--rate`` the runs form a paired ladder: every round runs every variant at every
rate (the rates ascending, the variants' order rotated by one per rate and per round), records
under ``DIR/rate_R/NAME-ROUND``. Beside each rate's report, :func:`ladder_lines` gives each
variant's highest sustained rate, from the attainment pooled over the rounds, and its ratio to
the best of the others: the setups' capacities compared on the same minutes of the box, where
separate sweeps follow the box's speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bench.goodput_workloads import WORKLOADS
from bench.paired import FAILED_TTFT_S, RequestOutcome, compare, read_outcomes
from bench.report import read_requests_csv
from bench.sweep import passes, rate_dir

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
NOT_ROUTED = frozenset({"plain", "vllm_pd"})
"""Setups without pdserve's router: no timeline, no path counts."""


@dataclass(frozen=True)
class Variant:
    """A named setup of ``bench.pd_goodput`` with more ``pdserve up`` arguments."""

    name: str
    setup: str
    args: tuple[str, ...] = ()
    tree: str | None = None
    """Run pdserve from this source tree (an earlier commit's, for before/after), not this one."""


def parse_variants(specs: Sequence[str], arg_specs: Sequence[str],
                   tree_specs: Sequence[str] = ()) -> list[Variant]:
    """``NAME=SETUP`` specs, ``NAME=ARG`` arguments and ``NAME=DIR`` source trees as variants,
    in the order given; ValueError for a malformed spec, an unknown setup, a repeated name, an
    argument or tree for no variant, or a tree without pdserve's sources."""
    from bench.pd_goodput import SETUPS

    names: dict[str, str] = {}
    for spec in specs:
        name, sep, setup = spec.partition("=")
        if not sep or not name or not setup:
            raise ValueError(f"--variant {spec!r}: expected NAME=SETUP")
        if setup not in SETUPS:
            raise ValueError(f"--variant {spec!r}: unknown setup; allowed: {', '.join(SETUPS)}")
        if name in names:
            raise ValueError(f"--variant {name!r} given twice")
        names[name] = setup
    args: dict[str, list[str]] = {name: [] for name in names}
    for spec in arg_specs:
        name, sep, arg = spec.partition("=")
        if not sep or name not in args:
            raise ValueError(f"--variant-arg {spec!r}: expected NAME=ARG for a --variant NAME")
        args[name].append(arg)
    trees: dict[str, str] = {}
    for spec in tree_specs:
        name, sep, tree = spec.partition("=")
        if not sep or name not in names or name in trees:
            raise ValueError(f"--variant-tree {spec!r}: expected NAME=DIR, once, for a "
                             "--variant NAME")
        if not (Path(tree) / "serve" / "cli.py").is_file():
            raise ValueError(f"--variant-tree {spec!r}: no pdserve sources (serve/cli.py) there")
        trees[name] = str(Path(tree).resolve())
    if len(names) < 2:
        raise ValueError("give at least two --variant")
    return [Variant(n, s, tuple(args[n]), trees.get(n)) for n, s in names.items()]


def round_order(variants: Sequence[Variant], round_: int) -> list[Variant]:
    """The variants in the order round ``round_`` runs them: rotated by one each round."""
    k = round_ % len(variants)
    return [*variants[k:], *variants[:k]]


def run_dir(out: Path, name: str, round_: int, rate: float | None = None) -> Path:
    """Where one variant's run of one round keeps its records (``rate``: of a ladder)."""
    return (out if rate is None else rate_dir(out, rate)) / f"{name}-{round_}"


def sustained(attainment: Mapping[float, float | None]) -> float | None:
    """The highest rate that passes with every lower rate of the ladder passing too (None: the
    lowest failed or was not measured); a rate without a measurement ends the climb."""
    best = None
    for rate in sorted(attainment):
        if not passes(attainment[rate]):
            break
        best = rate
    return best


def capacity_range(rates: Sequence[float], rate: float | None) -> tuple[float, float]:
    """Where a sustained rate puts the capacity: from it up to the next rate (which failed or
    was not reached), ``(0, lowest)`` when the lowest failed, ``(top, inf)`` past the top."""
    if rate is None:
        return 0.0, rates[0]
    above = [r for r in rates if r > rate]
    return rate, above[0] if above else math.inf


def _rate_label(rates: Sequence[float], rate: float | None) -> str:
    """``3.5 (fails 4)``, ``>= 4 (the top)`` or ``< 2.5 (the lowest fails)``: the
    :func:`capacity_range` of a sustained rate, in words."""
    low, high = capacity_range(rates, rate)
    if rate is None:
        return f"< {high:g} (the lowest fails)"
    return f"{low:g} (fails {high:g})" if high < math.inf else f">= {low:g} (the top)"


def ratio_bounds(rates: Sequence[float], ours: float | None,
                 best: float | None) -> tuple[float, float]:
    """The bounds on one capacity over another that the ladder's rates allow (exclusive; 0 or
    inf where the ladder says nothing): the ratio of the rates sustained is not one. A side
    sustaining 4 against one sustaining 3.45 and failing 4 is above 1.00x, not 1.16x."""
    lo_a, hi_a = capacity_range(rates, ours)
    lo_b, hi_b = capacity_range(rates, best)
    return lo_a / hi_b, (hi_a / lo_b if lo_b > 0 else math.inf)


def _bracket_text(low: float, high: float) -> str:
    """``between 0.85x and 1.18x``, ``> 1.00x``, ``< 0.86x`` or empty (nothing known)."""
    if low > 0 and high < math.inf:
        return f"between {low:.2f}x and {high:.2f}x"
    if low > 0:
        return f"> {low:.2f}x"
    return f"< {high:.2f}x" if high < math.inf else ""


def ladder_lines(out: Path, names: Sequence[str], rounds: int,
                 rates: Sequence[float]) -> list[str]:
    """Per variant: its attainment at every rate pooled over the rounds, the highest rate it
    sustains (:func:`sustained`) pooled and per round, and that rate over the best of the other
    variants', with the bounds the rates put on the capacities' ratio (:func:`ratio_bounds`):
    a ratio of rungs is only as fine as the rungs."""
    rates = sorted(rates)
    pooled: dict[str, dict[float, float | None]] = {}
    lines = []
    for name in names:
        per_round: dict[int, dict[float, float | None]] = {r: {} for r in range(rounds)}
        pooled[name] = {}
        for rate in rates:
            met = total = 0
            for r in range(rounds):
                path = run_dir(out, name, r, rate) / "point" / "requests.csv"
                if not path.exists():
                    per_round[r][rate] = None
                    continue
                o = read_outcomes(path)
                run_met = sum(v.met for v in o.values())
                met, total = met + run_met, total + len(o)
                per_round[r][rate] = run_met / max(len(o), 1)
            pooled[name][rate] = met / total if total else None
        points = ", ".join(f"{rate:g}: " + ("-" if a is None else f"{a:.3f}")
                           for rate, a in pooled[name].items())
        rounds_said = "; ".join(_rate_label(rates, sustained(per_round[r]))
                                for r in range(rounds))
        lines.append(f"ladder {name}: {points} -> sustains "
                     f"{_rate_label(rates, sustained(pooled[name]))} pooled; per round "
                     f"{rounds_said}")
    for name in names:
        ours = sustained(pooled[name])
        others = {n: sustained(pooled[n]) for n in names if n != name}
        best_name = max(others, key=lambda n: others[n] or -1.0)
        best = others[best_name]
        if ours is None and best is None:
            rungs = "no ratio (both fail the lowest rate)"
        elif best is None:
            rungs = "> 1x (only this side sustains the lowest rate)"
        elif ours is None:
            rungs = "< 1x (this side fails the lowest rate)"
        elif ours == best == rates[-1]:
            rungs = "no ratio (both pass the top rate)"
        else:
            rungs = f"{ours / best:.2f}x by rungs"
        bracket = _bracket_text(*ratio_bounds(rates, ours, best))
        lines.append(f"ladder {name} / best other ({best_name}): {rungs}"
                     + (f"; capacities' ratio {bracket}" if bracket else ""))
    return lines


def _tpots(requests_csv: Path) -> dict[int, float]:
    return {int(r["index"]): float(r["tpot_s"]) for r in read_requests_csv(requests_csv)
            if r["ok"] == "1" and r["tpot_s"]}


FAILED_TAIL_S = FAILED_TTFT_S / 1000
"""A TTFT difference this large (1,000 s) is no real one: the percentile was interpolated
toward the TTFT a failed request counts as (:data:`bench.paired.FAILED_TTFT_S`)."""


def pair_line(a: str, b: str, oa: Mapping[K, RequestOutcome], ob: Mapping[K, RequestOutcome],
              ta: Mapping[K, float], tb: Mapping[K, float]) -> str:
    """``a`` against ``b`` on the requests both replays hold: met by one only (McNemar p),
    TTFT p99 difference (a minus b) with its 95 % interval (where failed requests reach the
    tail, how many each side failed instead), median paired TPOT difference."""
    c = compare(oa, ob)
    diffs = [ta[k] - tb[k] for k in ta if k in tb]
    tpot = (f"TPOT median paired diff {statistics.median(diffs) * 1e3:+.2f} ms, {a} slower on "
            f"{sum(d > 0 for d in diffs)}/{len(diffs)}") if diffs else "TPOT: no pairs"
    lo, hi = c.ttft_p99_ci_s
    if max(abs(c.ttft_p99_diff_s), abs(lo), abs(hi)) >= FAILED_TAIL_S:
        failed = [sum(1 for k in oa if k in ob and o[k].ttft_s is None) for o in (oa, ob)]
        ttft = (f"TTFT p99 diff: failed requests reach the tail ({a} {failed[0]} failed, "
                f"{b} {failed[1]})")
    else:
        ttft = (f"TTFT p99 diff {c.ttft_p99_diff_s * 1e3:+.0f} ms "
                f"[{lo * 1e3:+.0f}, {hi * 1e3:+.0f}]")
    return (f"{a} only met {c.only_ours_met} / {b} only met {c.only_peer_met} "
            f"(p {c.attainment_p:.3g}); {ttft}; {tpot}")


def _pooled(per_round: Mapping[int, Mapping[int, V]]) -> dict[tuple[int, int], V]:
    """One variant's requests over its rounds, keyed by (round, index)."""
    return {(r, i): v for r, run in per_round.items() for i, v in run.items()}


def plan_line(point: Path, outcomes: Mapping[int, RequestOutcome],
              tpots: Mapping[int, float]) -> str:
    """``held 15 of 438 (met 12); TPOT observed / predicted p10 0.71, p50 1.32, p90 2.40``:
    the point's router timeline joined by request id with the client's records (``outcomes``
    and ``tpots`` by index, as the report read them; empty when no request was planned by the
    cost model)."""
    timeline = point / "timeline.jsonl"
    if not timeline.exists():
        return ""
    plans: dict[int, dict[str, float]] = {}
    for line in timeline.read_text().splitlines():
        record = json.loads(line)
        rid, plan = str(record.get("request_id", "")), record.get("plan")
        index = rid.removeprefix("bench-")
        if plan and rid.startswith("bench-") and index.isdigit() and int(index) in outcomes:
            plans[int(index)] = plan
    if not plans:
        return ""
    held = [i for i, p in plans.items() if float(p.get("hold_s") or 0) > 0]
    met = sum(1 for i in held if outcomes[i].met)
    ratios = sorted(tpots[i] / float(p["predicted_tpot_s"]) for i, p in plans.items()
                    if i in tpots and float(p.get("predicted_tpot_s") or 0) > 0)
    line = f"held {len(held)} of {len(plans)} (met {met})"
    if len(ratios) >= 10:
        q = statistics.quantiles(ratios, n=10)
        line += (f"; TPOT observed / predicted p10 {q[0]:.2f}, p50 {statistics.median(ratios):.2f}"
                 f", p90 {q[-1]:.2f}")
    return line


def report(out: Path, names: Sequence[str], rounds: int) -> list[str]:
    """Attainment of every run, then every pair of variants per round and pooled over the
    rounds (requests keyed by (round, index)); runs without records are left out."""
    outcomes: dict[str, dict[int, dict[int, RequestOutcome]]] = {n: {} for n in names}
    tpots: dict[str, dict[int, dict[int, float]]] = {n: {} for n in names}
    lines = []
    for name in names:
        for r in range(rounds):
            path = run_dir(out, name, r) / "point" / "requests.csv"
            if not path.exists():
                continue
            o = outcomes[name][r] = read_outcomes(path)
            t = tpots[name][r] = _tpots(path)
            met = sum(v.met for v in o.values())
            plans = plan_line(path.parent, o, t)
            lines.append(f"{name} round {r}: attainment {met / max(len(o), 1):.3f} "
                         f"({len(o) - met} of {len(o)} missed)" + (f"; {plans}" if plans else ""))
    for a, b in itertools.combinations(names, 2):
        both = [r for r in range(rounds) if r in outcomes[a] and r in outcomes[b]]
        for r in both:
            lines.append(f"round {r}: " + pair_line(a, b, outcomes[a][r], outcomes[b][r],
                                                    tpots[a][r], tpots[b][r]))
        if both:
            lines.append("pooled: " + pair_line(a, b, _pooled(outcomes[a]), _pooled(outcomes[b]),
                                                _pooled(tpots[a]), _pooled(tpots[b])))
    return lines


def ladder_order(variants: Sequence[Variant], rates: Sequence[float],
                 round_: int) -> list[tuple[float, Variant]]:
    """What one round runs, in order: the rates ascending, at each every variant, rotated by
    one per rate and per round (so at every rate each variant takes each place over as many
    rounds as there are variants)."""
    return [(rate, v) for i, rate in enumerate(sorted(rates))
            for v in round_order(variants, round_ + i)]


def run(variants: Sequence[Variant], args: argparse.Namespace, out: Path) -> None:
    """Every round: each variant started, warmed up, replayed at each rate point and stopped."""
    from bench.pd_goodput import fresh_point, warmup_trace

    workload = WORKLOADS[args.workload]
    warm = warmup_trace(workload, out / "warmup.csv", args)
    ladder = len(args.rate) > 1
    for r in range(args.rounds):
        for rate, v in ladder_order(variants, args.rate, r):
            where = run_dir(out, v.name, r, rate if ladder else None)
            timeline = where / "timeline.jsonl"
            routed = v.setup not in NOT_ROUTED and v.name not in args.no_timeline
            extra = (*v.args, f"--router-arg=--timeline-file={timeline}") if routed else v.args
            load0 = os.getloadavg()[0]
            ran = fresh_point(v.setup, workload, rate, where, warm, args, extra,
                             None if v.tree is None else Path(v.tree),
                             timeline=timeline if routed else None)
            (where / "point" / "paths.json").write_text(json.dumps(ran.paths, indent=2))
            summary, layout = ran.summary, ran.layout
            print(f"round {r} {v.name} at {rate:g} req/s: attainment "
                  f"{summary['slo_attainment']:.3f} (load {load0:.2f} -> "
                  f"{os.getloadavg()[0]:.2f}; {layout})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd_variants",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--rate", type=float, action="append", required=True,
                        help="req/s of the point; repeat for a paired ladder")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=SETUP")
    parser.add_argument("--variant-arg", action="append", default=[], metavar="NAME=ARG",
                        help="one more `pdserve up` argument for variant NAME (repeat)")
    parser.add_argument("--variant-tree", action="append", default=[], metavar="NAME=DIR",
                        help="run variant NAME's pdserve from source tree DIR (e.g. `git "
                        "archive COMMIT | tar -x -C DIR`, with the built kernels/native copied "
                        "in) for before/after in one run")
    parser.add_argument("--no-timeline", action="append", default=[], metavar="NAME",
                        help="variant NAME's router writes no timeline file (what the file "
                        "itself costs; no plan line then)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--point-s", type=float, default=60.0)
    parser.add_argument("--warmup-requests", type=int, default=40)
    parser.add_argument("--min-prefill-tokens", type=int, default=512,
                        help="selective disaggregation threshold of setup (selective)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", action="store_true",
                        help="run nothing: report the runs already in --out")
    args = parser.parse_args(argv)
    try:
        variants = parse_variants(args.variant, args.variant_arg, args.variant_tree)
    except ValueError as exc:
        print(f"pd_variants: {exc}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("pd_variants: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.report and args.out is None:
        print("pd_variants: --report needs --out", file=sys.stderr)
        return 2
    if any(rate <= 0 for rate in args.rate) or len(set(args.rate)) < len(args.rate):
        print("pd_variants: --rate must be > 0 and not repeated", file=sys.stderr)
        return 2
    args.rate = sorted(args.rate)
    out = args.out or Path(tempfile.mkdtemp(prefix="pd-variants-"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        (out / "variants.json").write_text(json.dumps(
            {"workload": args.workload, "rates": args.rate, "rounds": args.rounds,
             "seed": args.seed, "variants": [vars(v) for v in variants]}, indent=2))
        run(variants, args, out)
    names = [v.name for v in variants]
    if len(args.rate) == 1:
        print("\n".join(report(out, names, args.rounds)))
        return 0
    for rate in args.rate:
        print(f"-- {rate:g} req/s")
        print("\n".join(report(rate_dir(out, rate), names, args.rounds)))
    print("\n".join(ladder_lines(out, names, args.rounds, args.rate)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
