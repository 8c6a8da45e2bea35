"""Autoscaling in simulation: the SLO planner vs an HPA-style threshold autoscaler vs static
pools, on a family of generated trace shapes and seeds.

    python -m bench.autoscale_sim [--shapes steps,ramp,diurnal,spikes,burstgpt] [--seeds 5]
                                  [--duration-s 1200] [--peak-rps 32] [--jobs 1] [--out DIR]
                                  [--oracle]

Each trace: gamma inter-arrivals (BurstGPT's burstiness) at a rate that follows a shape of
``bench.sim.shapes`` (0.1 .. 1.0 of ``--peak-rps``), lengths and sessions as in
``bench.synth.gamma_rows``. The hardware is the simulator's default instance
``--slowdown`` (2) times slower (an 8B model on an L40S-class GPU rather than an H100), so a
trace of a few thousand requests needs pools of realistic size and the table runs in minutes.
Per shape and seed it prints SLO attainment (requests within both SLOs) and billed
instance-seconds of:

- ``planner``: ``router.autoscale.planner`` from 1 + 1 up to ``--max-prefill``/``--max-decode``;
- ``threshold``: the HPA-style baseline with the same bounds;
- ``static-peak``: the smallest fixed pool reaching 0.95 on that trace (bisection: decode with
  prefill at its maximum, then prefill with that decode; runs stop once they cannot reach it);
- ``static-max``: the fixed pool at the autoscalers' maximum;
- ``oracle`` (``--oracle``): the clairvoyant reference of :mod:`bench.sim.oracle`, pools from
  a steady-state table sized for the true rate over the next start + interval; what pool-size
  efficiency alone allows, with nothing left to forecast. ``--oracle-lookahead-s 0`` makes it
  the *reactive* reference: it knows the true rate now, exactly, and nothing of what comes
  (a causal planner knows less); ``--oracle-floor L`` keeps at least level L's pool.

Worker starts take ``--start-delay-s`` (30), the autoscalers decide every 10 s. ``TUNED``
names the shape/seed pairs the planner's knobs were tuned on; the table marks the others
held out and summarises both groups.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.sim import shapes
from bench.sim.autoscale import (
    SIM_MOVES,
    AutoscaleSettings,
    Hopeless,
    StaticController,
    autoscale_summary,
    make_controller,
)
from bench.sim.engine import Moves, PoolController, RunResult, simulate
from bench.sim.oracle import (
    LEVELS,
    TARGET,
    OracleController,
    PoolTable,
    SteadyState,
    monotone,
    smallest_pool,
)
from bench.sim.sweep import SweepConfig, make_policy
from bench.sim.workload import SimRequest, WorkloadConfig, build_requests
from bench.synth import iter_varying_rows
from router import settings as shared
from router.autoscale.profile import InstanceProfile

logger = logging.getLogger(__name__)

#: seed of the oracle's constant-rate traces (none of the table's 0 .. N-1)
STEADY_SEED = 1000
#: shape -> seeds the planner's knobs were tuned on; every other pair is held out
TUNED: dict[str, tuple[int, ...]] = {"steps": (0, 1, 2), "ramp": (0, 1, 2),
                                     "diurnal": (0, 1, 2)}

#: issue 5's small-config shape (kept for its test): one 30 % ramp up and down
RAMP: tuple[tuple[float, float], ...] = (
    (0.0, 0.1), (0.15, 0.1), (0.45, 1.0), (0.6, 1.0), (0.85, 0.1), (1.0, 0.1))


def make_trace(duration_s: float, peak_rps: float, seed: int,
               shape: Sequence[tuple[float, float]] = RAMP,
               burstiness: float = shapes.DEFAULT_BURSTINESS) -> list[SimRequest]:
    """Simulator requests whose rate follows ``shape`` (``(fraction of the run, relative
    rate)`` knots) times ``peak_rps``."""
    knots = [(f * duration_s, r * peak_rps) for f, r in shape]
    rows = list(iter_varying_rows(knots, seed=seed, burstiness=burstiness))
    return build_requests(rows, WorkloadConfig(), seed)


def shape_trace(shape: str, duration_s: float, peak_rps: float, seed: int) -> list[SimRequest]:
    """The trace of one named shape of :mod:`bench.sim.shapes`."""
    knots = shapes.knots(shape, duration_s, seed)
    rel = [(t / duration_s, r) for t, r in knots]
    return make_trace(duration_s, peak_rps, seed, rel,
                      shapes.BURSTINESS.get(shape, shapes.DEFAULT_BURSTINESS))


def run(reqs: Sequence[SimRequest], policy: str, settings: AutoscaleSettings,
        ttft_slo_s: float, tpot_slo_s: float, profile: InstanceProfile | None = None,
        controller: PoolController | None = None) -> RunResult:
    """One replay with pools sized by ``settings`` (or by ``controller`` when given) of
    instances that perform as ``profile`` (default: :class:`InstanceProfile`'s)."""
    profile = profile or InstanceProfile()
    pp, dp = profile.prefill, profile.decode
    cfg = SweepConfig(settings.max_prefill, settings.max_decode, ttft_slo_s, tpot_slo_s, pp, dp)
    ctx = statistics.fmean(r.prompt_tokens for r in reqs)
    if controller is None:
        controller = make_controller(settings, ttft_slo_s, tpot_slo_s, profile, ctx)
    # the engine only ever moves requests of policies that name an alternate candidate
    return simulate(reqs, make_policy(policy, cfg), settings.max_prefill, settings.max_decode,
                    pp, dp, rebalance_threshold_s=ttft_slo_s,
                    controller=controller, start_delay_s=settings.start_delay_s,
                    moves=settings.moves)


@dataclass(frozen=True)
class Scenario:
    """Everything but the trace that one table row holds fixed."""

    duration_s: float = 1200.0
    peak_rps: float = 32.0
    slowdown: float = 2.0
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    max_prefill: int = 12
    max_decode: int = 8
    start_delay_s: float = 30.0
    interval_s: float = 10.0
    policy: str = shared.default("policy")
    """The router's default prefill placement policy."""
    warm_blocks: int = 0
    """Prefix blocks a joining prefill instance is warmed with (``Moves.warm_blocks``)."""

    def moves(self) -> Moves:
        """The simulated router's moves: :data:`SIM_MOVES` with this scenario's warming."""
        return replace(SIM_MOVES, warm_blocks=self.warm_blocks)

    def profile(self) -> InstanceProfile:
        """The default instance ``slowdown`` x slower."""
        return InstanceProfile().scaled(self.slowdown)


def static_peak(reqs: Sequence[SimRequest], sc: Scenario
                ) -> tuple[int, int, dict[str, Any] | None]:
    """The smallest static pool reaching :data:`TARGET`: decode bisected with prefill at its
    maximum, then prefill with that decode (assumes attainment grows with either pool).
    ``None`` as the summary when even the maximum misses."""
    profile = sc.profile()
    budget = int(len(reqs) * (1 - TARGET))
    done: dict[tuple[int, int], dict[str, Any] | None] = {}

    def attempt(p: int, d: int) -> dict[str, Any] | None:
        if (p, d) not in done:
            ctl = StaticController((p, d), sc.ttft_slo_s, sc.tpot_slo_s, budget, sc.interval_s)
            try:
                res = run(reqs, sc.policy, AutoscaleSettings("static", p, d), sc.ttft_slo_s,
                          sc.tpot_slo_s, profile, ctl)
                m = autoscale_summary(res, sc.ttft_slo_s, sc.tpot_slo_s)
                done[p, d] = m if m["slo_attainment"] >= TARGET else None
            except Hopeless:
                done[p, d] = None
        return done[p, d]

    found = smallest_pool(lambda p, d: attempt(p, d) is not None, sc.max_prefill,
                          sc.max_decode)
    if found is None:
        return sc.max_prefill, sc.max_decode, None
    return found[0], found[1], attempt(*found)


def steady_pool(burstiness: float, level: float, sc: Scenario) -> tuple[int, int]:
    """The smallest pool meeting :data:`TARGET` at a constant ``level`` of the peak rate with
    gamma(``burstiness``) gaps, warm (:class:`bench.sim.oracle.SteadyState`), on a trace of
    its own seed (:data:`STEADY_SEED`, none of the table's)."""
    state = SteadyState(sc.policy, sc.ttft_slo_s, sc.tpot_slo_s, sc.profile(),
                        sc.max_prefill, sc.max_decode)
    reqs = make_trace(state.duration_s, sc.peak_rps * level, STEADY_SEED,
                      ((0.0, 1.0), (1.0, 1.0)), burstiness)
    return state.pool(reqs)


def oracle_tables(shape_names: Sequence[str], sc: Scenario, jobs: int = 1
                  ) -> dict[float, PoolTable]:
    """The oracle's steady-state table per burstiness the shapes use."""
    bursts = sorted({shapes.BURSTINESS.get(s, shapes.DEFAULT_BURSTINESS) for s in shape_names})
    work = [(b, lv) for b in bursts for lv in LEVELS]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            pools = list(pool.map(steady_pool, *zip(*work, strict=True), [sc] * len(work)))
    else:
        pools = [steady_pool(b, lv, sc) for b, lv in work]
    return {b: monotone({lv: pl for (bb, lv), pl in zip(work, pools, strict=True) if bb == b})
            for b in bursts}


def one_row(shape: str, seed: int, sc: Scenario,
            tables: dict[float, PoolTable] | None = None, margin: float = 1.0,
            lookahead_s: float | None = None, floor: float = 0.0) -> dict[str, Any]:
    """Planner, threshold, static-peak and static-max on one trace, and the clairvoyant
    oracle (sizing for ``margin`` x the highest level within ``lookahead_s``, default a start
    plus an interval, and for ``floor`` at least) when given its steady-state ``tables`` (per
    burstiness)."""
    t0 = time.perf_counter()
    reqs = shape_trace(shape, sc.duration_s, sc.peak_rps, seed)
    profile = sc.profile()
    row: dict[str, Any] = {"shape": shape, "seed": seed, "requests": len(reqs),
                           "held_out": seed not in TUNED.get(shape, ())}
    for mode in ("planner", "threshold", "static"):
        settings = AutoscaleSettings(mode, sc.max_prefill, sc.max_decode,
                                     interval_s=sc.interval_s, start_delay_s=sc.start_delay_s,
                                     moves=sc.moves())
        res = run(reqs, sc.policy, settings, sc.ttft_slo_s, sc.tpot_slo_s, profile)
        row["static-max" if mode == "static" else mode] = autoscale_summary(
            res, sc.ttft_slo_s, sc.tpot_slo_s)
    if tables is not None:
        table = tables[shapes.BURSTINESS.get(shape, shapes.DEFAULT_BURSTINESS)]
        ahead = sc.start_delay_s + sc.interval_s if lookahead_s is None else lookahead_s
        oracle = OracleController(shapes.knots(shape, sc.duration_s, seed), table, ahead,
                                  sc.interval_s, margin=margin, floor=floor)
        res = run(reqs, sc.policy, AutoscaleSettings("planner", sc.max_prefill, sc.max_decode,
                                                     moves=sc.moves()),
                  sc.ttft_slo_s, sc.tpot_slo_s, profile, oracle)
        row["oracle"] = autoscale_summary(res, sc.ttft_slo_s, sc.tpot_slo_s)
        row["oracle_margin"] = margin
        row["oracle_lookahead_s"] = ahead
        row["oracle_floor"] = floor
    p, d, peak = static_peak(reqs, sc)
    row["static-peak"] = peak or row["static-max"]
    row["static_peak_pool"] = f"{p}+{d}" if peak else "none"
    row["wall_s"] = time.perf_counter() - t0
    return row


def _att(m: dict[str, Any]) -> float:
    return float(m["slo_attainment"])


def _inst(m: dict[str, Any]) -> float:
    return float(m["instance_seconds"]["total"])


def _autos(rows: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The autoscalers the rows hold, in print order (the oracle only when every row has it)."""
    oracle = all("oracle" in r for r in rows)
    return ("planner", "threshold", "oracle") if oracle else ("planner", "threshold")


def print_table(rows: Sequence[dict[str, Any]], sc: Scenario) -> None:
    """Per shape and seed, then per shape and per group (tuned / held out)."""
    print(f"{sc.duration_s:.0f} s traces, peak {sc.peak_rps:g} req/s (min 0.1x); instances "
          f"{sc.slowdown:g}x the default's times; SLOs TTFT {sc.ttft_slo_s:g} s, TPOT "
          f"{sc.tpot_slo_s:g} s; start delay {sc.start_delay_s:.0f} s; autoscalers 1+1 .. "
          f"{sc.max_prefill}+{sc.max_decode}; attainment = share of requests within both SLOs")
    print(f"{'shape':<9}{'seed':>4} {'reqs':>5} {'':>4} | {'planner':>13} {'x peak':>6} | "
          f"{'threshold':>13} {'x peak':>6} | {'static-peak':>19} | {'static-max':>13}")
    for r in rows:
        pk = _inst(r["static-peak"])
        cells = []
        for name in _autos(rows)[:2]:
            m = r[name]
            cells.append(f"{_att(m):.4f} {_inst(m):>7.0f} {_inst(m) / pk:>6.3f}")
        print(f"{r['shape']:<9}{r['seed']:>4} {r['requests']:>5} "
              f"{'held' if r['held_out'] else 'tune':>4} | {cells[0]} | {cells[1]} | "
              f"{r['static_peak_pool']:>5} {_att(r['static-peak']):.4f} "
              f"{_inst(r['static-peak']):>7.0f} | {_att(r['static-max']):.4f} "
              f"{_inst(r['static-max']):>7.0f}"
              + (f" | oracle {_att(r['oracle']):.4f} {_inst(r['oracle']) / pk:>6.3f}"
                 if "oracle" in r else ""))
    print()
    print(f"{'group':<18} {'n':>3} | {'planner att mean/min':>21} {'x peak':>6} | "
          f"{'threshold att mean/min':>22} {'x peak':>6}")

    def summary(name: str, group: Sequence[dict[str, Any]]) -> None:
        if not group:
            return
        cells = []
        for auto in _autos(group):
            atts = [_att(r[auto]) for r in group]
            ratio = statistics.fmean(_inst(r[auto]) / _inst(r["static-peak"]) for r in group)
            cells.append(f"{statistics.fmean(atts):.4f} / {min(atts):.4f} {ratio:>14.3f}")
        print(f"{name:<18} {len(group):>3} | {cells[0]:>28} | {cells[1]:>29}"
              + (f" | oracle {cells[2]:>28}" if len(cells) > 2 else ""))

    for shape in dict.fromkeys(r["shape"] for r in rows):
        summary(shape, [r for r in rows if r["shape"] == shape])
    summary("tuned", [r for r in rows if not r["held_out"]])
    summary("held out", [r for r in rows if r["held_out"]])
    summary("all", rows)


def main(argv: list[str] | None = None) -> int:
    """Run the table; ``--out DIR`` also writes ``DIR/table.json``."""
    ap = argparse.ArgumentParser(prog="python -m bench.autoscale_sim",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(shapes.SHAPES))
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 per shape")
    ap.add_argument("--duration-s", type=float, default=Scenario.duration_s)
    ap.add_argument("--peak-rps", type=float, default=Scenario.peak_rps)
    ap.add_argument("--slowdown", type=float, default=Scenario.slowdown)
    # The shared spelling (router.settings); --slo-ttft/--slo-tpot kept as aliases.
    ap.add_argument("--ttft-slo-s", "--slo-ttft", dest="slo_ttft", type=float,
                    default=Scenario.ttft_slo_s)
    ap.add_argument("--tpot-slo-s", "--slo-tpot", dest="slo_tpot", type=float,
                    default=Scenario.tpot_slo_s)
    ap.add_argument("--max-prefill", type=int, default=Scenario.max_prefill)
    ap.add_argument("--max-decode", type=int, default=Scenario.max_decode)
    ap.add_argument("--start-delay-s", type=float, default=Scenario.start_delay_s)
    ap.add_argument("--policy", default=Scenario.policy)
    ap.add_argument("--oracle", action="store_true",
                    help="add the clairvoyant reference (bench.sim.oracle): pools from a "
                         "steady-state table, sized for the true rate a start ahead")
    ap.add_argument("--oracle-margin", type=float, default=1.0,
                    help="the oracle sizes for this x the true level (default 1.0)")
    ap.add_argument("--oracle-lookahead-s", type=float, default=None,
                    help="seconds of the true rate the oracle sees ahead (default: a start "
                         "plus an interval; 0: the reactive reference, the rate now only)")
    ap.add_argument("--oracle-floor", type=float, default=0.0,
                    help="the oracle keeps at least this level's pool (fraction of the peak)")
    ap.add_argument("--warm-blocks", type=int, default=0,
                    help="prefix blocks a joining prefill instance is warmed with (default 0)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--out", default=None, help="write table.json here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in names:
        shapes.knots(name, 60.0, 0)  # unknown shape: ValueError naming the allowed ones
    sc = Scenario(args.duration_s, args.peak_rps, args.slowdown, args.slo_ttft, args.slo_tpot,
                  args.max_prefill, args.max_decode, args.start_delay_s, policy=args.policy,
                  warm_blocks=args.warm_blocks)
    t0 = time.perf_counter()
    tables = oracle_tables(names, sc, args.jobs) if args.oracle else None
    if tables is not None:
        for b, table in tables.items():
            logger.info("oracle table, gamma(%g) gaps: %s", b,
                        ", ".join(f"{lv:g}: {p}+{d}" for lv, (p, d) in table.items()))
    jobs = [(shape, seed) for shape in names for seed in range(args.seeds)]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(one_row, *zip(*jobs, strict=True),
                                 [sc] * len(jobs), [tables] * len(jobs),
                                 [args.oracle_margin] * len(jobs),
                                 [args.oracle_lookahead_s] * len(jobs),
                                 [args.oracle_floor] * len(jobs)))
    else:
        rows = [one_row(shape, seed, sc, tables, args.oracle_margin, args.oracle_lookahead_s,
                        args.oracle_floor) for shape, seed in jobs]
    print_table(rows, sc)
    logger.info("done in %.0f s", time.perf_counter() - t0)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.json").write_text(json.dumps(
            {"scenario": sc.__dict__, "tuned": TUNED, "rows": rows,
             "oracle_tables": {str(b): {str(lv): pl for lv, pl in t.items()}
                               for b, t in (tables or {}).items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
