"""Goodput head-to-head: the highest request rate each setup serves at >= 90 % SLO attainment.

    python -m bench.pd_goodput [--workloads prefill_heavy,decode_heavy,mix,switching,multi_turn]
                               [--setups plain,aggregated,pd,selective,adaptive,vllm_pd]
                               [--point-s 30] [--rates 3,6,12,24] [--repeats 1] [--out DIR]

For each workload of the family (``bench.goodput_workloads``: a BurstGPT-shaped trace from
``pdserve bench synth`` and its own TTFT/TPOT SLOs) every setup is swept (the listed rates in
ascending order until one fails, then bisection to 5 %, ``bench.sweep``) on this machine, in
turn. Every rate point replays its own trace lasting ``--point-s`` wall seconds at that rate
(``rate * point_s`` requests; ``pdserve bench replay --rate``), so a rate passes only if the
setup sustains it: a fixed number of requests would shrink to a burst of a second or two at
high rates, which queues absorb, and would overstate what a setup sustains. The trace and the
prompts of a rate are the same for every setup (same seed); no two points of a run share a
prompt (``goodput_workloads.prompt_seed``), so no point is served from the caches an earlier
one filled.

  plain       one plain vLLM server on all cores (``pdserve worker --role aggregated``, no
              router): a different deployment, the single-engine reference;
  aggregated  ``pdserve up --mode aggregated --replicas 2``: 2 plain vLLM workers, one core
              each, behind the router;
  pd          ``pdserve up``: 1 prefill + 1 decode, one core each;
  selective   (pd) with ``--disagg-min-prefill-tokens`` (short or decode-cached prompts skip
              the prefill hop);
  adaptive    ``pdserve up --mode adaptive --replicas 2``: 2 flex workers, one core each, the
              router choosing whole or P/D per request (``router.policy.adaptive``);
  vllm_pd     vLLM's own P/D stack (``bench.field_pd``: NixlConnector engines behind
              ``vllm-router``), settings printed.

Every setup is started, swept alone and stopped before the next; the pdserve setups' routers get
the workload's SLOs. With ``--interleave`` the setups are swept in lockstep instead: each step
runs every setup's next point in turn (the order rotated by one each step), each point alone on
the box from a fresh start and warm-up, so the setups compared meet the same minutes of a
drifting box (:func:`run_interleaved`). Each setup first serves a discarded warm-up replay.
The table prints the highest passing rate, attainment at each rate tried, the path mix, where
each process ran and the load average, the machine's speed before and after each setup
(``bench.box_speed``) and during each point (``bench.box_watch``: each core's loop speed and
steal, medians of samples taken every 2 s beside the run; ``--no-box-watch`` to leave it out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import box_speed, box_watch, field_pd
from bench.box_speed import BoxSpeed
from bench.goodput_workloads import (
    WARMUP,
    WORKLOADS,
    Workload,
    build_trace,
    prompt_seed,
    rate_point_trace,
    sustained_rate,
)
from bench.placement import children, placement_of
from bench.sweep import RateSearch, lockstep, passes, rate_dir
from bench.sweep import sweep as bisect_rates
from serve.tiny_model import build_tiny_model

SETUPS = ("plain", "aggregated", "pd", "selective", "adaptive", "vllm_pd")
POINT_KEYS = ("requests_completed", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90",
              "load_avg_1m", "box_during")
"""What a rate point's record keeps of its replay's summary."""
SERVED = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pdserve_command(*args: str) -> list[str]:
    """The command line of ``pdserve ARGS`` with this interpreter."""
    return [sys.executable, "-m", "serve.cli", *args]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], workers: dict[str, int],
                 timeout_s: float = 900.0) -> None:
    """Until ``url``/health answers 200 with at least ``workers`` (e.g. ``aggregated_workers``
    2) registered (none asked: any 200, a JSON body or not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            resp = httpx.get(f"{url}/health", timeout=2)
            if resp.status_code == 200 and (not workers or all(
                    resp.json().get(k, 0) >= n for k, n in workers.items())):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready in {timeout_s} s")


def stop_session(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session and everything it started (SIGINT, SIGKILL
    after 120 s)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Running:
    """A started setup: how to stop it and what to print about it."""

    def __init__(self, url: str, stop: Any, pid: int, note: str = "") -> None:
        self.url = url
        self.stop = stop
        self.pid = pid
        self.note = note


def start(setup: str, workload: Workload, min_prefill_tokens: int,
          extra: Sequence[str] = (), tree: Path | None = None) -> Running:
    """Start ``setup`` (the pdserve ones through the pdserve CLI, with ``workload``'s SLOs;
    ``extra``: more ``pdserve up`` arguments, e.g. ``--worker-arg=--timeline-file=F``;
    ``tree``: run pdserve from that source tree, e.g. an earlier commit's, instead of this
    one)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if setup == "vllm_pd":
        stack = field_pd.start(str(build_tiny_model()), SERVED, port)
        return Running(url, stack.stop, stack.procs[0].pid, field_pd.SETTINGS)
    redis = f"redis://127.0.0.1:{_free_port()}/0"
    common = ["--port", str(port), "--redis-url", redis, "--served-model-name", SERVED,
              "--ttft-slo-s", str(workload.ttft_slo_s), "--tpot-slo-s", str(workload.tpot_slo_s),
              *extra]
    ready: dict[str, int] = {}
    if setup == "pd":
        cmd = pdserve_command("up", *common)
    elif setup == "selective":
        cmd = pdserve_command("up", *common,
                              f"--router-arg=--disagg-min-prefill-tokens={min_prefill_tokens}")
    elif setup == "aggregated":
        cmd = pdserve_command("up", *common, "--mode", "aggregated", "--replicas", "2")
        ready = {"aggregated_workers": 2}
    elif setup == "adaptive":
        cmd = pdserve_command("up", *common, "--mode", "adaptive", "--replicas", "2")
        ready = {"flex_workers": 2}
    else:
        cmd = pdserve_command("worker", "--role", "aggregated", "--port", str(port),
                              "--served-model-name", SERVED)
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tree, env=env)
    wait_healthy(url, proc, ready)
    return Running(url, lambda: stop_session(proc), proc.pid)


def warmup_trace(workload: Workload, path: Path, args: argparse.Namespace) -> Path:
    """The trace a warm-up replays the first ``--warmup-requests`` of (both phases of
    switching), written to ``path``."""
    return build_trace(workload, path, 2.0 * max(args.warmup_requests, 20), args.seed + 1000,
                       phases=2)


def layout_of(pid: int) -> str:
    """``name[pid]:cores ...``: where each process under ``pid`` may run."""
    return " ".join(f"{name}:{cores}" for name, cores in placement_of(children(pid)).items())


def warm_up(url: str, trace: Path, out: Path, args: argparse.Namespace) -> None:
    """A discarded replay of the trace's first requests: every setup meets the sweep warm
    (tokenizer loaded, vLLM's first long-prompt shapes compiled, connections open)."""
    subprocess.run(pdserve_command("bench", "replay", "--url", url, "--trace", str(trace),
                                   "--rate", "1", "--max-requests", str(args.warmup_requests),
                                   "--seed", str(prompt_seed(args.seed, WARMUP)),
                                   "--out", str(out), "--no-progress", "--no-plots",
                                   "--no-sessions"),
                   check=True, stdout=subprocess.DEVNULL)


def replay_point(url: str, workload: Workload, rate: float, out: Path,
                 args: argparse.Namespace, watch_file: Path | None = None) -> dict[str, Any]:
    """Replay ``workload`` at ``rate`` req/s for its point length against ``url``; the run's
    summary (``slo_attainment`` and the latency percentiles, and ``box_during``: the
    ``watch_file`` samples taken while it ran, per core)."""
    span = workload.point_s(args.point_s)
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    trace = rate_point_trace(workload, out / "trace.csv", rate, span, args.seed)
    subprocess.run(pdserve_command("bench", "replay", "--url", url, "--trace", str(trace),
                                   "--rate", str(rate), "--ttft-slo-s", str(workload.ttft_slo_s),
                                   "--tpot-slo-s", str(workload.tpot_slo_s), "--out", str(out),
                                   "--seed", str(prompt_seed(args.seed, rate)),
                                   "--no-progress", "--no-plots",
                                   *(() if workload.sessions else ("--no-sessions",))),
                   check=True, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["load_avg_1m"] = os.getloadavg()[0]
    if watch_file is not None and watch_file.exists():
        summary["box_during"] = box_watch.summarize(box_watch.load(watch_file), started,
                                                    time.time())
    return summary


def sweep(url: str, out: Path, workload: Workload, args: argparse.Namespace,
          watch_file: Path | None = None) -> dict[str, Any]:
    """The highest rate ``url`` sustains within ``workload``'s SLOs (``bench.sweep``: the
    listed rates, then bisection) and every point tried."""
    rates = [float(x) for x in args.rates.split(",") if x.strip()]

    async def run_at(rate: float) -> dict[str, Any]:
        return await asyncio.to_thread(replay_point, url, workload, rate,
                                       rate_dir(out, rate), args, watch_file)

    res = asyncio.run(bisect_rates(run_at, rates, bisect_steps=args.bisect_steps))
    points = [{"rate": p["rate"], "slo_attainment": p["slo_attainment"], "passed": p["passed"],
               **{k: p["summary"].get(k) for k in POINT_KEYS}} for p in res.points]
    doc = {"max_rate_rps": res.max_rate, "points": points}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(doc, indent=2))
    return doc


def path_counts(url: str) -> dict[str, float]:
    """The router's ``pdserve_router_paths_total`` counters at ``url``, by ``path/reason``
    (empty when it cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {f"{m[1]}/{m[2]}": float(m[3]) for m in re.finditer(
        r'pdserve_router_paths_total\{path="(\w+)",reason="(\w+)"\} (\S+)', text)}


def _box(reading: dict[str, float]) -> str:
    return BoxSpeed(**reading).line()


def during_line(points: Sequence[dict[str, Any]]) -> str:
    """``core 0 24.1-27.9, core 1 22.0-26.3 M loops/s, steal <= 0.0 %``: the range, over the
    points, of each core's median speed while the point ran (empty without samples)."""
    by_core: dict[str, list[dict[str, float]]] = {}
    for point in points:
        for core, reading in (point.get("box_during") or {}).items():
            by_core.setdefault(core, []).append(reading)
    if not by_core:
        return ""
    cores = ", ".join(f"core {core} {min(r['cpu_mops'] for r in rs):.1f}-"
                      f"{max(r['cpu_mops'] for r in rs):.1f}" for core, rs in by_core.items())
    steal = max(r["steal_pct"] for rs in by_core.values() for r in rs)
    return f"{cores} M loops/s, steal <= {steal:.1f} %"


def run_one(setup: str, workload: Workload, warm_trace: Path, out: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    """Start, warm up, sweep and stop ``setup`` on ``workload``; its result record."""
    load0, box0 = os.getloadavg()[0], box_speed.measure()
    out.mkdir(parents=True, exist_ok=True)
    watch_file = out / "box-watch.jsonl"
    watcher = None if args.no_box_watch else subprocess.Popen(
        [sys.executable, "-m", "bench.box_watch", "--out", str(watch_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        running = start(setup, workload, args.min_prefill_tokens, args.pdserve_arg)
        try:
            layout = layout_of(running.pid)
            if args.warmup_requests:
                warm_up(running.url, warm_trace, out / "warmup", args)
            doc = sweep(running.url, out / "sweep", workload, args,
                        None if watcher is None else watch_file)
            paths = path_counts(running.url)
        finally:
            running.stop()
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait()
    return {"max_rate_rps": doc["max_rate_rps"], "points": doc["points"], "layout": layout,
            "load_before": load0, "load_after": os.getloadavg()[0], "paths": paths,
            "box_before": box0.as_dict(), "box_after": box_speed.measure().as_dict(),
            "note": running.note}


@dataclass(frozen=True)
class FreshPoint:
    """One rate point run from a fresh start (:func:`fresh_point`)."""

    summary: dict[str, Any]
    """The replay's summary (:func:`replay_point`)."""
    paths: dict[str, float]
    """``pdserve_router_paths_total`` by ``path/reason`` during the point (not the warm-up)."""
    layout: str
    note: str


def fresh_point(setup: str, workload: Workload, rate: float, where: Path, warm_trace: Path,
                args: argparse.Namespace, extra: Sequence[str] = (), tree: Path | None = None,
                watch_file: Path | None = None, timeline: Path | None = None) -> FreshPoint:
    """Start ``setup`` (:func:`start`, with ``extra`` and ``tree``), warm it up into
    ``where/warmup``, replay ``rate`` into ``where/point`` and stop it. ``timeline``: the router
    timeline file ``extra`` names, moved into ``warmup/`` after the warm-up and into ``point/``
    after the point, so each holds its own requests alone."""
    (where / "point").mkdir(parents=True, exist_ok=True)
    running = start(setup, workload, args.min_prefill_tokens, extra, tree)
    try:
        layout = layout_of(running.pid)
        if args.warmup_requests:
            warm_up(running.url, warm_trace, where / "warmup", args)
        if timeline is not None and timeline.exists():
            (where / "warmup").mkdir(exist_ok=True)
            timeline.rename(where / "warmup" / "timeline.jsonl")
        before = path_counts(running.url)
        summary = replay_point(running.url, workload, rate, where / "point", args, watch_file)
        paths = {k: v - before.get(k, 0.0) for k, v in path_counts(running.url).items()}
        if timeline is not None and timeline.exists():
            timeline.rename(where / "point" / "timeline.jsonl")
    finally:
        running.stop()
    return FreshPoint(summary, paths, layout, running.note)


def run_interleaved(setups: Sequence[str], workload: Workload, warm_trace: Path, out: Path,
                    args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Sweep every setup of ``setups`` on ``workload`` in lockstep: in each step every setup
    whose search is not over is started, warmed up, run at its next rate and stopped, in an
    order rotated by one each step. The box's speed drifts by tens of percent within minutes
    (docs/pd-goodput.md), so setups swept one after the other meet different boxes; in
    lockstep each step's points run minutes apart. Each point starts from a fresh cluster.
    Per setup, the record :func:`run_one` returns (``layout`` from its first point, ``paths``
    summed over its points, the load and box speed before the first step and after the
    last)."""
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    searches = {s: RateSearch(rates, bisect_steps=args.bisect_steps) for s in setups}
    load0, box0 = os.getloadavg()[0], box_speed.measure().as_dict()
    records: dict[str, dict[str, Any]] = {
        s: {"points": [], "paths": {}, "layout": "", "note": "", "load_before": load0,
            "box_before": box0} for s in setups}
    watch_file = out / "box-watch.jsonl"
    watcher = None if args.no_box_watch else subprocess.Popen(
        [sys.executable, "-m", "bench.box_watch", "--out", str(watch_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def point(setup: str, rate: float, step: int) -> bool:
        rec = records[setup]
        run = fresh_point(setup, workload, rate, rate_dir(out / setup, rate), warm_trace,
                          args, args.pdserve_arg,
                          watch_file=None if watcher is None else watch_file)
        rec["layout"] = rec["layout"] or run.layout
        rec["note"] = run.note
        for k, v in run.paths.items():
            rec["paths"][k] = rec["paths"].get(k, 0.0) + v
        summary = run.summary
        att = summary.get("slo_attainment")
        passed = passes(att)
        rec["points"].append({"rate": rate, "slo_attainment": att, "passed": passed,
                              "step": step, **{k: summary.get(k) for k in POINT_KEYS}})
        print(f"  step {step} {setup}: {rate:g} req/s attainment {att} "
              f"({'pass' if passed else 'fail'}; load {summary['load_avg_1m']:.2f})", flush=True)
        return passed

    try:
        lockstep(searches, point)
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait()
    load1, box1 = os.getloadavg()[0], box_speed.measure().as_dict()
    for setup, rec in records.items():
        rec.update(max_rate_rps=searches[setup].lo, load_after=load1, box_after=box1)
        (out / setup).mkdir(parents=True, exist_ok=True)
        (out / setup / "sweep.json").write_text(json.dumps(
            {"max_rate_rps": rec["max_rate_rps"], "points": rec["points"]}, indent=2))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd_goodput",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--point-s", type=float, default=30.0,
                        help="wall seconds each rate point lasts (rate x this = its requests)")
    parser.add_argument("--rates", default="3,6,12,24", help="req/s tried in ascending order")
    parser.add_argument("--bisect-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="sweeps of each setup")
    parser.add_argument("--min-prefill-tokens", type=int, default=512,
                        help="selective disaggregation threshold of setup (selective)")
    parser.add_argument("--warmup-requests", type=int, default=10,
                        help="requests replayed (and discarded) before each sweep; 0 = none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interleave", action="store_true",
                        help="sweep the setups in lockstep, one point each in turn, each point "
                        "from a fresh start (run_interleaved), instead of one setup after the "
                        "other")
    parser.add_argument("--no-box-watch", action="store_true",
                        help="do not sample the cores' speed during the points (bench.box_watch)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--pdserve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the pdserve setups' `pdserve up` (repeat), "
                             "e.g. --pdserve-arg=--worker-arg=--timeline-file=/tmp/kv.jsonl")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pd-goodput-"))
    out.mkdir(parents=True, exist_ok=True)
    setups = [s for s in args.setups.split(",") if s]
    for name in setups:
        if name not in SETUPS:
            raise SystemExit(f"unknown setup {name!r}; allowed: {', '.join(SETUPS)}")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for wname in [w for w in args.workloads.split(",") if w]:
        if wname not in WORKLOADS:
            raise SystemExit(f"unknown workload {wname!r}; allowed: {', '.join(WORKLOADS)}")
        workload = WORKLOADS[wname]
        warm = warmup_trace(workload, out / f"{wname}-warmup.csv", args)
        results[wname] = {}
        for repeat in range(args.repeats):
            done = run_interleaved(setups, workload, warm, out / wname / f"step-{repeat}", args) \
                if args.interleave else {}
            for setup in setups:
                res = done[setup] if args.interleave else \
                    run_one(setup, workload, warm, out / wname / f"{setup}-{repeat}", args)
                results[wname].setdefault(setup, []).append(res)
                print(f"{wname:13s} {setup:10s} run {repeat + 1}: {res['max_rate_rps']} req/s "
                      f"(load {res['load_before']:.2f} -> {res['load_after']:.2f}; box "
                      f"{_box(res['box_before'])} -> {_box(res['box_after'])}; during the "
                      f"points {during_line(res['points']) or '-'}; {res['layout']}) "
                      f"{res['paths'] or ''}", flush=True)
                (out / "goodput.json").write_text(json.dumps(results, indent=2))
    print_table(results, args)
    print(f"\nwritten: {out / 'goodput.json'}")
    return 0


def print_table(results: dict[str, dict[str, list[dict[str, Any]]]],
                args: argparse.Namespace) -> None:
    """Max rate per workload and setup, adaptive's ratio to the best static setup over the
    same engines (aggregated, pd, selective) and to vLLM's P/D stack."""
    setups = [s for s in SETUPS if any(s in r for r in results.values())]
    print(f"\nrate points: {args.point_s:.0f} s each (switching: "
          f"{WORKLOADS['switching'].point_s(args.point_s):.0f} s), seed {args.seed}; rates "
          f"{args.rates} then bisection; min over {args.repeats} run(s)")
    print(f"{'workload':13s} {'SLO ttft/tpot':>14s} " + " ".join(f"{s:>10s}" for s in setups)
          + "   adaptive/best-static  adaptive/vllm_pd")
    for wname, by_setup in results.items():
        w = WORKLOADS[wname]
        rates = {s: sustained_rate(runs) for s, runs in by_setup.items()}
        static = max((rates[s] for s in ("aggregated", "pd", "selective") if s in rates),
                     default=0.0)
        ratio = f"{rates['adaptive'] / static:.2f}" if "adaptive" in rates and static else "-"
        field = f"{rates['adaptive'] / rates['vllm_pd']:.2f}" \
            if "adaptive" in rates and rates.get("vllm_pd") else "-"
        cells = " ".join(f"{rates[s]:>10.2f}" if s in rates else f"{'-':>10s}" for s in setups)
        print(f"{wname:13s} {w.ttft_slo_s:>6.1f}/{w.tpot_slo_s:<7.3f} {cells}   {ratio:>20s}  "
              f"{field:>16s}")
    if any("vllm_pd" in r for r in results.values()):
        print(f"vllm_pd settings: {field_pd.SETTINGS}")


if __name__ == "__main__":
    raise SystemExit(main())
