"""Routing on the real cluster: pdserve's policies and vllm-router's in front of the same workers.

    python -m bench.routing_real [--traces shared_prefix,api] [--rates 2,4,6] [--point-s 60]
                                 [--routers dualmap,llmd_default,...,vllm-router:cache_aware]
                                 [--out DIR]

One ``pdserve up --mode aggregated --replicas 2`` (two plain vLLM engines on the tiny model, one
core each, prefix caching on) serves every point. Each router in ``--routers`` is started in turn
in front of those same two workers and stopped before the next:

  NAME                  ``pdserve router --policy NAME`` (any prefill policy of
                        ``router.policy.registry``: dualmap, the peers sglang_cache_aware,
                        llmd_default, dynamo_kv, aibrix_prefix, preble_e2, the baselines), reading
                        the workers from the cluster's Redis;
  vllm-router:POLICY    the vLLM project's Rust router (``pip install vllm-router``, the
                        ``bench`` extra) with ``--policy POLICY`` (cache_aware, power_of_two, ...)
                        and the two workers' URLs.

Traces (``pdserve bench synth``, replayed by ``pdserve bench replay --rate``): ``shared_prefix``
(800-token prompts, 80 % conversation turns resent with their earlier turns) and ``api`` (API
calls, 400-token prompts, 8 shared system prompts of 300 tokens). Every rate point replays its
own ``--point-s`` seconds of trace (the same for every router). Before each point both engines'
prefix caches are emptied (vLLM's ``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``) and the
router is started afresh, so neither the engines nor the router carry anything from the point
before (a router kept across points still believes the engines hold the prefixes it sent them).

Per point: the prefix-cache hit rate from vLLM's own counters (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``, both engines), the prompt tokens each engine computed or
reused (``vllm:prompt_tokens_total``), TTFT and TPOT p50/p90/p99, SLO attainment (TTFT 1 s,
TPOT 50 ms), failures, the load average and where each process ran. First (``--profile``, on by
default) the idle first worker is profiled (``pdserve bench profile``, ``DIR/profile.json``): the
calibration ``python -m bench.sim_fidelity`` replays the same points with.

vllm-router's ``cache_aware`` (0.1.17) routes on token ids: before placing a request it asks
every worker to tokenize it (``POST /v1/completions/render``), and where that fails it places
the request on the least-loaded worker without learning anything (its ``missing_tokens``
outcome), i.e. it no longer routes by prefix. vLLM 0.32 answers that route only when started
with ``--enable-scale-out`` (otherwise 403), so the workers here are started with it whenever a
vllm-router is among ``--routers`` (every router then meets the same workers), the route is
checked once, and each vllm-router point records the router's own decision counts
(``vllm_router_prefix_routing_decisions_total`` by outcome) and says when any went without
tokens. A pdserve router's point records its own placement decisions by reason
(``pdserve_router_routing_decisions_total``: for DualMap how often the SLO switch fired).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.goodput_workloads import Workload, build_trace
from bench.paired import RequestOutcome, read_outcomes
from bench.paired import compare as paired_compare
from bench.pd_goodput import SERVED, pdserve_command, stop_session, wait_healthy
from bench.placement import affinity, children, descendants
from bench.proc_cpu import CpuWatch, core_shares
from kvtransfer.signing import worker_api_key
from router.samples import parse_samples, total
from serve.redis_server import free_port
from serve.tiny_model import build_tiny_model
from serve.vllm_cli import ENV_VLLM_ARGS

TTFT_SLO_S = 1.0
TPOT_SLO_S = 0.05
TRACES: dict[str, Workload] = {w.name: w for w in (
    Workload("shared_prefix", 800, 64, TTFT_SLO_S, TPOT_SLO_S, max_prompt_tokens=2500,
             max_response_tokens=192, conversation_fraction=0.8, sessions=True),
    Workload("api", 400, 64, TTFT_SLO_S, TPOT_SLO_S, max_prompt_tokens=1500,
             max_response_tokens=192),
)}
"""The traces by name (the goodput family's shape: prompt and answer medians, SLOs)."""
RATES = {"shared_prefix": (2.0, 4.0, 6.0), "api": (3.0, 6.0, 9.0)}
"""Each trace's default rate points (req/s): from light load to past where the two engines
keep 90 % of requests within the SLOs."""
API_SYSTEM_PROMPTS = 8
API_SYSTEM_PROMPT_TOKENS = 300
DEFAULT_ROUTERS = ("dualmap", "sglang_cache_aware", "llmd_default", "dynamo_kv",
                   "aibrix_prefix", "preble_e2", "round_robin", "vllm-router:cache_aware",
                   "vllm-router:power_of_two")
SCALE_OUT_ARG = "--enable-scale-out"
"""vLLM's flag that serves ``/v1/completions/render``, the tokenizing route vllm-router's
``cache_aware`` needs (vLLM 0.32 answers 403 without it)."""
DECISIONS = "vllm_router_prefix_routing_decisions_total"
PDSERVE_DECISIONS = "pdserve_router_routing_decisions_total"
"""pdserve's placement decisions by reason (DualMap: cache_affinity, cache_holder, slo_switch,
load, single_candidate; another policy: its name)."""
_DECISION_LABEL = {DECISIONS: "outcome", PDSERVE_DECISIONS: "reason"}
"""Which label each router's decision counter is summed by."""
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:prompt_tokens_total")


@dataclass
class Cluster:
    """The shared workers (``pdserve up --mode aggregated --replicas 2``) and how to reach
    them."""

    proc: subprocess.Popen[bytes]
    url: str
    redis_url: str
    env: dict[str, str]
    workers: list[str] = field(default_factory=list)

    @property
    def worker_key(self) -> str:
        """The workers' vLLM API key (derived from the cluster secret, as pdserve's router
        sends it)."""
        return worker_api_key(self.env["PDSERVE_CLUSTER_SECRET"].encode())


def start_cluster(log_dir: Path, scale_out: bool = False) -> Cluster:
    """Two aggregated workers behind pdserve's own router; returns once both answer.
    ``scale_out``: the workers also serve vLLM's render route (:data:`SCALE_OUT_ARG`)."""
    port, redis = free_port(), f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": secrets.token_urlsafe(32),
           "VLLM_SERVER_DEV_MODE": "1"}
    if scale_out:
        env[ENV_VLLM_ARGS] = f"{env.get(ENV_VLLM_ARGS, '')} {SCALE_OUT_ARG}".strip()
    cmd = pdserve_command("up", "--mode", "aggregated", "--replicas", "2", "--port", str(port),
                          "--redis-url", redis, "--served-model-name", SERVED, "--ttft-slo-s",
                          str(TTFT_SLO_S), "--tpot-slo-s", str(TPOT_SLO_S), "--log-dir",
                          str(log_dir))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    cluster = Cluster(proc, f"http://127.0.0.1:{port}", redis, env)
    try:
        wait_healthy(cluster.url, proc, {"aggregated_workers": 2}, 900)
        data = httpx.get(f"{cluster.url}/workers", timeout=10).json()["data"]
        cluster.workers = sorted(w["url"] for w in data if w["role"] == "aggregated")
    except BaseException:
        stop_session(proc)
        raise
    return cluster


def renders(cluster: Cluster) -> bool:
    """Whether every worker tokenizes a completions request on vLLM's render route (what
    vllm-router's ``cache_aware`` asks before each placement)."""
    for url in cluster.workers:
        r = httpx.post(f"{url}/v1/completions/render", timeout=30,
                       headers={"Authorization": f"Bearer {cluster.worker_key}"},
                       json={"model": SERVED, "prompt": "one two three"})
        if r.status_code != 200 or not (r.json() or [{}])[0].get("token_ids"):
            print(f"render route of {url}: {r.status_code} {r.text[:200]}", flush=True)
            return False
    return True


@dataclass
class Router:
    """One router under test, running."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    metrics_url: str | None = None
    """vllm-router's Prometheus endpoint (None for pdserve's routers)."""


def decisions(router: Router) -> dict[str, float] | None:
    """The router's placement decisions so far: vllm-router's prefix-routing decisions by
    outcome (``prefix_hit``, ``prefix_miss``, ``missing_tokens``, ...), pdserve's by reason
    (``cache_affinity``, ``slo_switch``, ...); None for a router without them."""
    if router.metrics_url is None:
        return None
    return decision_counts(httpx.get(router.metrics_url, timeout=10).text)


def decision_counts(exposition: str) -> dict[str, float]:
    """:data:`DECISIONS` summed by outcome, or :data:`PDSERVE_DECISIONS` by reason, from a
    Prometheus text exposition."""
    out: dict[str, float] = {}
    for (name, labels), value in parse_samples(exposition).items():
        key = _DECISION_LABEL.get(name)
        if key is not None:
            label = dict(labels).get(key, "?")
            out[label] = out.get(label, 0.0) + value
    return out


def start_router(name: str, cluster: Cluster, extra: Sequence[str] = ()) -> Router:
    """``name``: a pdserve prefill policy or ``vllm-router:POLICY``; ``extra``: more
    arguments for a pdserve router (the later of two equal flags wins)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    metrics_url = f"{url}/metrics"
    if name.startswith("vllm-router:"):
        binary = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                             "vllm-router")
        if not os.path.exists(binary):
            raise RuntimeError("vllm-router is not installed (pip install 'pdserve[bench]')")
        metrics_port = free_port()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
               *cluster.workers, "--policy", name.split(":", 1)[1], "--api-key",
               cluster.worker_key, "--prometheus-port", str(metrics_port),
               "--log-level", "warning"]
        want: dict[str, int] = {}
    else:
        cmd = pdserve_command("router", "--host", "127.0.0.1", "--port", str(port),
                              "--redis-url", cluster.redis_url, "--policy", name,
                              "--ttft-slo-s", str(TTFT_SLO_S), "--tpot-slo-s", str(TPOT_SLO_S),
                              "--log-level", "WARNING", *extra)
        want = {"aggregated_workers": 2}
    proc = subprocess.Popen(cmd, env=cluster.env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, want, 180)
    except BaseException:
        stop_session(proc)
        raise
    return Router(name, url, proc, metrics_url)


def counters(workers: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each worker's prefix-cache and prompt-token counters, now."""
    out = {}
    for url in workers:
        samples = parse_samples(httpx.get(f"{url}/metrics", timeout=10).text)
        out[url] = {name: total(samples, name) for name in COUNTERS}
    return out


def cache_stats(before: Mapping[str, Mapping[str, float]],
                after: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """The prefix-cache hit rate over every worker between two :func:`counters` readings and
    the prompt tokens each worker took meanwhile."""
    def delta(url: str, name: str) -> float:
        return after[url][name] - before[url][name]

    hits = sum(delta(u, "vllm:prefix_cache_hits_total") for u in after)
    queries = sum(delta(u, "vllm:prefix_cache_queries_total") for u in after)
    return {"hit_rate": hits / queries if queries else None,
            "prompt_tokens": [delta(u, "vllm:prompt_tokens_total") for u in sorted(after)]}


def reset_caches(cluster: Cluster) -> None:
    """Empty both engines' prefix caches (needs ``VLLM_SERVER_DEV_MODE=1``)."""
    for url in cluster.workers:
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()


def replay(url: str, trace: Path, workload: Workload, rate: float | None, out: Path,
           api_key: str | None, max_requests: int | None = None) -> dict[str, Any]:
    """``pdserve bench replay`` of ``trace`` against ``url``; its summary."""
    cmd = pdserve_command("bench", "replay", "--url", url, "--trace", str(trace), "--model",
                          SERVED, "--tokenizer", str(build_tiny_model()),
                          "--ttft-slo-s", str(workload.ttft_slo_s), "--tpot-slo-s",
                          str(workload.tpot_slo_s), "--out", str(out), "--no-progress",
                          "--no-plots")
    cmd += ["--rate", str(rate)] if rate else ["--rate", "1"]
    if max_requests:
        cmd += ["--max-requests", str(max_requests)]
    if not workload.sessions:
        cmd += ["--no-sessions", "--system-prompts", str(API_SYSTEM_PROMPTS),
                "--system-prompt-tokens", str(API_SYSTEM_PROMPT_TOKENS)]
    if api_key:
        cmd += ["--api-key", api_key]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def profile_worker(cluster: Cluster, out: Path) -> None:
    """``pdserve bench profile`` of the first worker, idle (the simulator's calibration:
    ``python -m bench.sim_fidelity``)."""
    subprocess.run(pdserve_command("bench", "profile", "--url", cluster.workers[0], "--model",
                                   SERVED, "--tokenizer", str(build_tiny_model()), "--api-key",
                                   cluster.worker_key, "--out", str(out)),
                   check=True, stdout=subprocess.DEVNULL)


def layout(cluster: Cluster, router: Router) -> str:
    """Where each process may run: the workers (one core each), the router under test."""
    parts = [f"{name}:{affinity(pid)}" for name, pid in children(cluster.proc.pid).items()]
    cores = sorted({affinity(p) for p in [router.proc.pid, *descendants(router.proc.pid)]})
    return " ".join([*parts, f"{router.name}:{'|'.join(cores)}"])


def worker_processes(cluster: Cluster) -> dict[str, int]:
    """``worker:<cores>`` -> pid of each worker's top process under the cluster."""
    out = {}
    for pid in children(cluster.proc.pid).values():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv:
            out[f"worker:{affinity(pid)}"] = pid
    return out


def run_router(name: str, cluster: Cluster, workload: Workload, traces: Mapping[float, Path],
               out: Path, api_key: str | None, extra: Sequence[str] = ()
               ) -> list[dict[str, Any]]:
    """Every rate point of ``workload`` through router ``name``; one record per point. Each
    point gets emptied engine caches and a router started afresh after that, so no router
    carries what it believes the engines cache (its prefix tree, rings, load history) from
    one point to the next, while the engines no longer hold it."""
    points = []
    for rate, trace in sorted(traces.items()):
        reset_caches(cluster)
        router = start_router(name, cluster, extra)  # ready means first requests at full speed
        try:
            time.sleep(1.0)
            where = layout(cluster, router)
            before = counters(cluster.workers)
            load0 = os.getloadavg()[0]
            watch = CpuWatch(worker_processes(cluster), {"cluster": cluster.proc.pid,
                                                         "router": router.proc.pid,
                                                         "bench": os.getpid()})
            watch.start()
            summary = replay(router.url, trace, workload, rate, rate_dir(out, rate), api_key)
            cpu = watch.stop()
            time.sleep(1.5)  # an engine's last counters ship with its next step or stats tick
            stats = cache_stats(before, counters(cluster.workers))
            routed = decisions(router)
        finally:
            stop_session(router.proc)
        points.append({
            "router": name, "trace": workload.name, "rate": rate, **stats,
            **{k: summary.get(k) for k in (
                "requests_completed", "requests_failed", "slo_attainment", "ttft_p50",
                "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99")},
            "load_before": load0, "load_after": os.getloadavg()[0], "layout": where,
            "router_decisions": routed, "cpu": cpu})
        print(format_row(points[-1]), flush=True)
        print(f"  cpu: {cpu_line(cpu)}", flush=True)
        if routed is not None:
            warn = (" -- WARNING: requests placed without tokens (no prefix routing)"
                    if routed.get("missing_tokens") else "")
            print(f"  {name} decisions: {routed}{warn}", flush=True)
    return points


def cpu_line(cpu: Mapping[str, Any]) -> str:
    """One point's CPU record in a line: each worker's engine and frontend CPU as a share of
    wall time, the floating processes', and each engine's share of its core left to it."""
    wall = cpu["wall_s"] or 1.0
    shares = core_shares(cpu)
    parts = [f"{w} engine {v['engine_s'] / wall:.2f} frontend {v['frontend_s'] / wall:.2f} "
             f"(core left {shares[w]:.2f})" for w, v in cpu["workers"].items()]
    parts += [f"{k} {v / wall:.2f}" for k, v in cpu["floating_s"].items()]
    return "; ".join(parts) + f" (cores busy per wall second, over {wall:.0f} s)"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def format_row(p: Mapping[str, Any]) -> str:
    """One table row of a point."""
    hit = "-" if p["hit_rate"] is None else f"{p['hit_rate']:.1%}"
    tokens = " / ".join(f"{t / 1000:.0f}k" for t in p["prompt_tokens"])
    att = "-" if p["slo_attainment"] is None else f"{p['slo_attainment']:.3f}"
    return (f"| {p['trace']} | {p['rate']:g} | {p['router']} | {hit} | {tokens} | "
            f"{_ms(p['ttft_p50'])} / {_ms(p['ttft_p90'])} / {_ms(p['ttft_p99'])} | "
            f"{_ms(p['tpot_p50'])} / {_ms(p['tpot_p90'])} / {_ms(p['tpot_p99'])} | {att} | "
            f"{p['requests_failed']} | {p['load_before']:.1f}-{p['load_after']:.1f} |")


HEADER = ("| trace | req/s | router | prefix hit rate | prompt tokens per worker | "
          "TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | attainment | failed | load |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


AVERAGED = ("hit_rate", "ttft_p50", "ttft_p99", "slo_attainment")
"""The per-point figures :func:`aggregate` averages (and gives the range of)."""


def aggregate(points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per (trace, rate, router) over its rounds: the mean of each of
    :data:`AVERAGED` under the same key, its (min, max) under ``KEY_range``, and ``runs``;
    sorted by trace, rate, router. Figures missing in a round are left out of that mean."""
    groups: dict[tuple[str, float, str], list[Mapping[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["trace"], p["rate"], p["router"]), []).append(p)
    out = []
    for (trace, rate, router), group in sorted(groups.items()):
        rec: dict[str, Any] = {"trace": trace, "rate": rate, "router": router,
                               "runs": len(group)}
        for key in AVERAGED:
            vals = [float(p[key]) for p in group if p.get(key) is not None]
            rec[key] = sum(vals) / len(vals) if vals else None
            rec[f"{key}_range"] = (min(vals), max(vals)) if vals else None
        out.append(rec)
    return out


def _mean_cell(m: Mapping[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    if m[key] is None:
        return "-"
    lo, hi = m[f"{key}_range"]
    return f"{m[key] * scale:{fmt}} ({lo * scale:{fmt}}-{hi * scale:{fmt}})"


def format_mean_row(m: Mapping[str, Any]) -> str:
    """One row of the means table: mean (min-max) of hit rate, TTFT p50 and p99 (ms) and
    attainment."""
    return (f"| {m['trace']} | {m['rate']:g} | {m['router']} | {m['runs']} | "
            f"{_mean_cell(m, 'hit_rate', '.1%')} | {_mean_cell(m, 'ttft_p50', ',.0f', 1000)} | "
            f"{_mean_cell(m, 'ttft_p99', ',.0f', 1000)} | "
            f"{_mean_cell(m, 'slo_attainment', '.3f')} |")


MEAN_HEADER = ("| trace | req/s | router | runs | prefix hit rate | TTFT p50 ms | TTFT p99 ms | "
               "attainment |\n|---|---|---|---|---|---|---|---|")


def verdict(points: Sequence[Mapping[str, Any]], ours: str = "dualmap") -> list[str]:
    """Per trace and rate: whether ``ours`` has a hit rate >= every other router's at an equal
    or better TTFT p99 and attainment, and where not, who beat it on what."""
    lines = []
    for trace, rate in sorted({(p["trace"], p["rate"]) for p in points}):
        here = {p["router"]: p for p in points if (p["trace"], p["rate"]) == (trace, rate)}
        if ours not in here:
            continue
        mine = here[ours]
        behind = []
        for name, p in sorted(here.items()):
            what = [label for label, better in (
                ("hit rate", (p["hit_rate"] or 0) > (mine["hit_rate"] or 0)),
                ("TTFT p99", (p["ttft_p99"] or 0) < (mine["ttft_p99"] or 0)),
                ("attainment", (p["slo_attainment"] or 0) > (mine["slo_attainment"] or 0)))
                if better and name != ours]
            if what:
                behind.append(f"{name} ({', '.join(what)})")
        lines.append(f"{trace} @ {rate:g} req/s: {ours} "
                     + ("ahead of or equal to every router on all three" if not behind
                        else f"behind {'; '.join(behind)}"))
    return lines


def router_dir(out: Path, trace: str, router: str, round_: int | None = None) -> Path:
    """Where a run keeps one router's points of one trace (``round_``: its round's, when the
    run kept rounds apart)."""
    where = out / trace / router.replace(":", "-")
    return where if round_ is None else where / f"round_{round_}"


def rate_dir(where: Path, rate: float) -> Path:
    """One rate point's replay (``requests.csv``, ``summary.json``) under :func:`router_dir`."""
    return where / f"rate_{rate:g}"


def point_dir(out: Path, point: Mapping[str, Any], rounds: bool = False) -> Path:
    """A recorded point's replay directory under a run's output directory."""
    return rate_dir(router_dir(out, point["trace"], point["router"],
                               point.get("round", 0) if rounds else None), point["rate"])


def requests_csv(out: Path, point: Mapping[str, Any], rounds: bool) -> Path:
    """Where a point's per-request records are under a run's output directory."""
    return point_dir(out, point, rounds) / "requests.csv"


def _pooled_outcomes(points: Sequence[Mapping[str, Any]], out: Path, rounds: Mapping[str, bool]
                     ) -> dict[tuple[str, int, int], RequestOutcome]:
    """One router's requests at one point over its rounds (and runs), keyed by (run, round,
    request index)."""
    return {(p.get("run", ""), p.get("round", 0), i): o for p in points
            for i, o in read_outcomes(requests_csv(Path(p.get("run") or out), p,
                                                   rounds[p.get("run", "")])).items()}


def _mean_hit(points: Sequence[Mapping[str, Any]]) -> float:
    vals = [p["hit_rate"] for p in points if p["hit_rate"] is not None]
    return sum(vals) / len(vals) if vals else 0.0


def paired_verdict(points: Sequence[Mapping[str, Any]], out: Path, ours: str = "dualmap",
                   alpha: float = 0.05) -> list[str]:
    """Per trace and rate, ``ours`` against each other router on the same requests
    (:mod:`bench.paired`; rounds, and runs of the same traces, pooled request by request; a
    point's ``run``, when set, is the directory holding its records instead of ``out``):
    behind or ahead on attainment (exact McNemar) and TTFT p99 (paired bootstrap) only beyond
    chance at ``alpha``; the hit rate compared as measured (mean over rounds)."""
    rounds: dict[str, bool] = {}
    for p in points:  # whether the run kept its rounds apart in round_N directories
        rounds[p.get("run", "")] = rounds.get(p.get("run", ""), False) or bool(p.get("round"))
    lines = []
    for trace, rate in sorted({(p["trace"], p["rate"]) for p in points}):
        here = [p for p in points if (p["trace"], p["rate"]) == (trace, rate)]
        by_router: dict[str, list[Mapping[str, Any]]] = {}
        for p in here:
            by_router.setdefault(p["router"], []).append(p)
        if ours not in by_router:
            continue

        mine, my_hit = _pooled_outcomes(by_router[ours], out, rounds), _mean_hit(by_router[ours])
        parts, behind_any = [], False
        for peer in sorted(r for r in by_router if r != ours):
            c = paired_compare(mine, _pooled_outcomes(by_router[peer], out, rounds),
                               alpha=alpha)
            hit = _mean_hit(by_router[peer])
            behind = c.behind(alpha) + (["hit rate"] if hit > my_hit else [])
            behind_any = behind_any or bool(behind)
            ahead = c.ahead(alpha) + (["hit rate"] if my_hit > hit else [])
            parts.append(
                f"{peer}: hit rate {my_hit:.2%} vs {hit:.2%}; met by one only "
                f"{c.only_ours_met} / {c.only_peer_met} (p {c.attainment_p:.2f}); TTFT p99 "
                f"{c.ttft_p99_diff_s * 1000:+,.0f} ms [{c.ttft_p99_ci_s[0] * 1000:+,.0f}, "
                f"{c.ttft_p99_ci_s[1] * 1000:+,.0f}]; behind on "
                f"{', '.join(behind) or 'nothing'}, ahead on {', '.join(ahead) or 'nothing'}")
        head = (f"{trace} @ {rate:g} req/s: {ours} "
                + ("behind a peer" if behind_any else "meets the bar against every peer"))
        lines.append(head + "\n" + "\n".join(f"  - {x}" for x in parts))
    return lines


PAIRED_ALPHA = 0.05
"""Two-sided level of the request-by-request verdict."""


def paired_section(points: Sequence[Mapping[str, Any]], out: Path) -> str:
    """The request-by-request verdict as printed after a run's tables."""
    return (f"\nrequest by request (alpha {PAIRED_ALPHA}; a figure is behind or ahead only "
            "beyond chance):\n" + "\n".join(paired_verdict(points, out, alpha=PAIRED_ALPHA)))


def report(runs: Sequence[Path]) -> int:
    """Print finished runs' table and both verdicts again from their ``points.json``; several
    runs of the same traces (the same ``--seed``, ``--point-s`` and rates) are pooled as
    rounds."""
    points = []
    for run in runs:
        points += [{**p, "run": str(run)} for p in json.loads((run / "points.json").read_text())]
    out = runs[0]
    print(HEADER)
    for p in sorted(points, key=lambda p: (p["trace"], p["rate"])):
        print(format_row(p))
    pooled = len(runs) > 1 or any(p.get("round", 0) for p in points)
    print("\n" + "\n".join(verdict(aggregate(points) if pooled else points)))
    print(paired_section(points, out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_real",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--rates", default=None,
                        help="req/s of each point, for every trace (default: RATES)")
    parser.add_argument("--point-s", type=float, default=60.0,
                        help="wall seconds of trace each point replays")
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pdserve-arg", action="append", default=[],
                        help="one more argument for every pdserve router, e.g. "
                             "--pdserve-arg=--ttft-slo-s=0.5 (repeatable)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="profile a worker first (DIR/profile.json, the simulator's "
                             "calibration for python -m bench.sim_fidelity)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over every router (interleaved: A B C, A B C), each point "
                             "with a fresh router and emptied caches; the summary gives the mean "
                             "and range per router and the verdict is taken on the means")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, action="append", default=None, metavar="DIR",
                        help="run nothing: print the tables and verdicts of the run in DIR "
                             "(repeatable: runs of the same traces pooled)")
    args = parser.parse_args(argv)
    if args.report is not None:
        return report(args.report)
    out = args.out or Path(tempfile.mkdtemp(prefix="routing-real-"))
    out.mkdir(parents=True, exist_ok=True)
    routers = [r for r in args.routers.split(",") if r]
    print(f"load average before: {os.getloadavg()}", flush=True)
    vllm_router = any(r.startswith("vllm-router:") for r in routers)
    cluster = start_cluster(out / "logs", scale_out=vllm_router)
    points: list[dict[str, Any]] = []
    try:
        if vllm_router and not renders(cluster):
            raise RuntimeError("the workers do not serve /v1/completions/render: vllm-router's "
                               "cache_aware would place every request without tokens")
        print(f"workers {cluster.workers}; cores "
              + " ".join(f"{n}:{affinity(p)}" for n, p in children(cluster.proc.pid).items()),
              flush=True)
        if args.profile:
            profile_worker(cluster, out / "profile.json")
        for tname in [t for t in args.traces.split(",") if t]:
            workload = TRACES[tname]
            warm = build_trace(workload, out / f"{tname}-warm.csv", 30, args.seed + 1000)
            # both engines meet the first router warm (vLLM compiles its first shapes)
            replay(cluster.url, warm, workload, None, out / f"{tname}-cluster-warm", None,
                   max_requests=20)
            rates = [float(x) for x in args.rates.split(",")] if args.rates else RATES[tname]
            traces = {r: build_trace(workload, out / f"{tname}-{r:g}.csv", r * args.point_s,
                                     args.seed) for r in rates}
            print(f"\n{tname}: {args.point_s:.0f} s per point, seed {args.seed}\n{HEADER}",
                  flush=True)
            for round_ in range(args.repeats):
                for name in routers:
                    key = cluster.worker_key if name.startswith("vllm-router:") else None
                    where = router_dir(out, tname, name,
                                       round_ if args.repeats > 1 else None)
                    new = run_router(name, cluster, workload, traces, where, key,
                                     args.pdserve_arg)
                    points += [{**p, "round": round_} for p in new]
                    (out / "points.json").write_text(json.dumps(points, indent=2))
    finally:
        stop_session(cluster.proc)
    print(f"\n{HEADER}")
    for p in sorted(points, key=lambda p: (p["trace"], p["rate"])):
        print(format_row(p))
    if args.repeats > 1:
        means = aggregate(points)
        print(f"\nmeans over {args.repeats} rounds\n{MEAN_HEADER}")
        for m in means:
            print(format_mean_row(m))
        print("\n" + "\n".join(verdict(means)))
    else:
        print("\n" + "\n".join(verdict(points)))
    print(paired_section(points, out))
    print(f"load average after: {os.getloadavg()}\nwritten: {out / 'points.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
