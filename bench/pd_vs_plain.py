"""First-token latency and decode stalls: pdserve P/D vs one plain vLLM server, side by side.

    python -m bench.pd_vs_plain [--requests 12] [--prompt-tokens 1000] [--max-tokens 64]
                                [--isolate-cores] [--float] [--side-by-side [--relay-arms]]
                                [--breakdown] [--nixl] [--kv-transport ucx,nixl]

The same distinct prompts (exactly ``--prompt-tokens`` tokens, so no prefix-cache hits; greedy,
``ignore_eos``) are streamed one at a time through each setup, started and stopped in turn on
this machine, in one run:

  plain     one vLLM OpenAI server, no connector (the anchor);
  pdserve   ``pdserve up``: router + 1 prefill + 1 decode, KV pulled over UCX, the prefill's
            token streamed at once (``router.api.first_token``);
  pdserve-classic (``--classic``) the same with ``--no-first-token-from-prefill``;
  pdserve-nixl (``--kv-transport ucx,nixl``) pdserve with the NIXL transport under the same
            lease protocol (``pdserve worker --kv-transport nixl``);
  nixl      (``--nixl``) two vLLM servers with ``NixlConnector`` behind the same router.

Layouts (each one a column group): ``--isolate-cores`` gives every engine its own core(s), the
analog of separate machines, and runs the plain server on the cores one engine gets;
``--float`` leaves every engine floating over all cores (``--cpu-layout float``);
``--side-by-side`` runs the isolated P/D cluster and a plain server pinned to the decode engine's
core(s) at once, their requests alternating one at a time with a quiet pause before each
(:data:`QUIET_S`), so that both see the machine in the same minute: the like-for-like TPOT
ratio (this VM's speed drifts by a third between minutes; a plain run then a P/D run
measures the drift too); ``--relay-arms`` adds the decode engine reached directly and a router
serving whole requests on it, and splits P/D's extra TPOT into engine, relay and P/D path.
All three layouts by default. Per setup: TTFT, TPOT ((last - first token) /
(n - 1)), ITL (every gap between tokens) and stall time per request (sum of inter-token gaps
over 50 ms). ``--breakdown`` adds the median and p90 of every router and connector phase, read
from the timeline files the router and the workers write (``--timeline-file``), joined per
request on the wall clock. The load average and which process runs on which cores are printed
next to every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from bench.metrics import percentile
from bench.placement import placement_of
from bench.prompts import PromptSynthesizer, load_tokenizer
from kvtransfer.config import TRANSPORTS
from kvtransfer.signing import current, keyring_source, secret_from_env
from serve.cpu_layout import plan_cpus
from serve.redis_server import free_port, start_redis
from serve.tiny_model import build_tiny_model
from serve.worker import stop_process, vllm_command, vllm_env, wait_healthy

if TYPE_CHECKING:
    from serve.supervisor import Cluster, ClusterSettings

SERVED = "tiny-llama"
STALL_GAP_S = 0.05
QUIET_S = 1.3
"""Pause before each side-by-side request. vLLM's CPU workers keep busy-looping on
``sched_yield`` for 1 s after their last step (``SpinCondition.busy_loop_s`` in vLLM's
``shm_broadcast``): without the pause the server used last takes the shared core from the next."""


@dataclass
class Sample:
    """One streamed request."""

    request_id: str
    ttft_s: float
    token_times: list[float]
    sent_wall: float = 0.0
    """Wall clock when the request was sent (lines the client up with the timelines)."""

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    @property
    def stall_s(self) -> float:
        return sum(g for g in self.gaps if g > STALL_GAP_S)


@dataclass
class SetupResult:
    """Samples of one setup in one layout, with where its processes ran."""

    name: str
    layout: str
    samples: list[Sample]
    placement: dict[str, str] = field(default_factory=dict)
    loadavg: tuple[float, float] = (0.0, 0.0)
    timeline: dict[str, dict[str, float]] = field(default_factory=dict)
    """Request id -> phase durations (router and connector phases; --breakdown)."""


def make_prompts(model_dir: Path, n: int, tokens: int) -> list[str]:
    """``n`` distinct prompts of exactly ``tokens`` tokens."""
    synth = PromptSynthesizer(load_tokenizer(str(model_dir)), seed=0, sessions=False)
    return [synth.prompt(tokens).text for _ in range(n)]


def stream_one(client: httpx.Client, base: str, prompt: str, max_tokens: int,
               request_id: str, headers: Mapping[str, str] | None = None) -> Sample:
    """Stream one completion and stamp each content chunk (``client`` keeps its connection
    alive across requests, as load testers do)."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sent_wall = time.time()
    t0 = time.perf_counter()
    stamps: list[float] = []
    with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600,
                       headers={"x-request-id": request_id, **(headers or {})}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{base}: no token streamed for {request_id}")
    return Sample(request_id, stamps[0] - t0, stamps, sent_wall)


def run_prompts(base: str, prompts: list[str], max_tokens: int, tag: str) -> list[Sample]:
    """Warm up (two throwaway requests), then the prompts one at a time."""
    with httpx.Client(trust_env=False) as client:
        for i in range(2):
            stream_one(client, base, f"warm up {i} " * 40, 8,
                       f"warm-{tag}-{i}-{uuid.uuid4().hex[:6]}")
        return [stream_one(client, base, p, max_tokens, f"b-{tag}-{i}-{uuid.uuid4().hex[:8]}")
                for i, p in enumerate(prompts)]


def read_timelines(paths: list[Path], samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Join the client's stamps, router and connector timeline lines into phases per measured
    request (warm-ups left out): ``client.*`` are the hops between client and router."""
    lines = []
    for path in paths:
        if path.exists():
            lines += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    routers = {x["request_id"]: x for x in lines if x["source"] == "router"}
    out: dict[str, dict[str, float]] = {}
    for sample in samples:
        rid = sample.request_id
        rec = routers.get(rid)
        if rec is None:
            continue
        events = rec["events"]
        first_token_wall = sample.sent_wall + sample.ttft_s
        phases = {"client.to_router": events["received"] - sample.sent_wall}
        phases.update({f"router.{k}": v for k, v in rec["phases"].items()})
        # the event after which the router relays the first token
        relay = "prefill_answered" if rec.get("path") == "pd_first_token" else \
            "decode_first_byte"
        if relay in events:
            phases["client.first_token_after_router"] = first_token_wall - events[relay]
        for x in lines:  # vLLM's ids embed the router's: cmpl-<id>-<n>-<suffix>
            if x["source"] == "kv" and rid in x["request_id"]:
                phases.update({f"kv.{k}": v for k, v in x["phases"].items()})
        out[rid] = phases
    return out


def start_plain(model: Path, port: int, cpus: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """One plain vLLM OpenAI server (no connector) on ``port``, pinned to ``cpus`` (none:
    floating)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(vllm_command(str(model), "127.0.0.1", port, SERVED, None, None),
                            env=vllm_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=pin)


def cluster_pids(cluster: Cluster) -> dict[str, int]:
    """Role (and ``router``) -> pid of a running cluster's children, for ``placement_of``."""
    named = {f"{w.role}": w.proc.pid for w in cluster.workers}
    if cluster.router is not None:
        named["router"] = cluster.router.pid
    return named


def bench_plain(model: Path, prompts: list[str], max_tokens: int, layout: str,
                cpus: tuple[int, ...]) -> SetupResult:
    port = free_port()
    proc = start_plain(model, port, cpus)
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}", proc, 600))
        placement = placement_of({"plain": proc.pid})
        samples = run_prompts(f"http://127.0.0.1:{port}", prompts, max_tokens, f"plain-{layout}")
        return SetupResult("plain", layout, samples, placement,
                           os.getloadavg()[:2])  # type: ignore[arg-type]
    finally:
        stop_process(proc)


def _cluster_settings(model: Path, layout: str, tmp: Path, first_token: bool, transport: str
                      ) -> tuple[ClusterSettings, str, Path, Path]:
    """``pdserve up``'s settings for one setup: (settings, name, router and connector timeline
    files)."""
    from serve.supervisor import ClusterSettings

    name = ("pdserve" + ("" if transport == "ucx" else f"-{transport}")
            + ("" if first_token else "-classic"))
    router_tl, kv_tl = tmp / f"router-{name}-{layout}.jsonl", tmp / f"kv-{name}-{layout}.jsonl"
    router_args = [f"--timeline-file={router_tl}"]
    if not first_token:
        router_args.append("--no-first-token-from-prefill")
    settings = ClusterSettings(
        model=str(model), served_model_name=SERVED, port=free_port(),
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        cpu_layout="float" if layout == "float" else "auto",
        worker_args=(f"--timeline-file={kv_tl}", f"--kv-transport={transport}"),
        router_args=tuple(router_args))
    return settings, name, router_tl, kv_tl


def bench_pdserve(model: Path, prompts: list[str], max_tokens: int, layout: str,
                  tmp: Path, first_token: bool = True, transport: str = "ucx") -> SetupResult:
    from serve.supervisor import Cluster

    settings, name, router_tl, kv_tl = _cluster_settings(model, layout, tmp, first_token,
                                                         transport)
    cluster = Cluster(settings)
    cluster.start()
    try:
        asyncio.run(cluster.wait_ready())
        placement = placement_of(cluster_pids(cluster))
        samples = run_prompts(cluster.url, prompts, max_tokens, f"{name}-{layout}")
        time.sleep(1.0)  # connector stats reach the API server with the next engine steps
        load = os.getloadavg()[:2]
    finally:
        cluster.stop()
    return SetupResult(name, layout, samples, placement, load,  # type: ignore[arg-type]
                       read_timelines([router_tl, kv_tl], samples))


RELAY_ARMS = ("decode-direct", "whole")
"""``--relay-arms``: the decode engine reached directly (our connector loaded, no router, no
KV pulled), and a second router forced to serve whole requests on it (``--path-policy
whole``): beside P/D and plain, they split P/D's extra TPOT into the engine, the relay and
the P/D path."""


def bench_side_by_side(model: Path, prompts: list[str], max_tokens: int, tmp: Path,
                       transport: str = "ucx", quiet_s: float = QUIET_S,
                       relay_arms: bool = False) -> list[SetupResult]:
    """pdserve P/D (isolated layout) and a plain vLLM server pinned to the decode engine's
    cores, both up at once (with ``relay_arms``, also :data:`RELAY_ARMS`). One request at a
    time, each after ``quiet_s`` of quiet, round after round; every round each arm takes one
    prompt, the arms' order rotating by one per round."""
    from serve.supervisor import Cluster

    layout = "side-by-side"
    settings, name, router_tl, kv_tl = _cluster_settings(model, layout, tmp, True, transport)
    cluster = Cluster(settings)
    children: list[subprocess.Popen[bytes]] = []
    cluster.start()
    try:
        asyncio.run(cluster.wait_ready())
        decode = next((w for w in cluster.workers if w.role == "decode" and w.cpus), None)
        if decode is None:
            print("side-by-side: the decode engine has no cores of its own (too few cores for "
                  "the isolated layout): skipped")
            return []
        port = free_port()
        children.append(start_plain(model, port, decode.cpus))
        arms: dict[str, tuple[str, dict[str, str]]] = {
            name: (cluster.url, {}), "plain": (f"http://127.0.0.1:{port}", {})}
        asyncio.run(wait_healthy(arms["plain"][0], children[0], 600))
        named = {**cluster_pids(cluster), "plain": children[0].pid}
        if relay_arms:
            ring = current(keyring_source(*secret_from_env(cluster.env)))
            key = {"authorization": f"Bearer {ring.worker_api_keys[0]}"} if ring else {}
            arms["decode-direct"] = (decode.url, key)
            whole_port = free_port()
            children.append(subprocess.Popen(
                [sys.executable, "-m", "router.main", "--host", "127.0.0.1", "--port",
                 str(whole_port), "--redis-url", cluster.redis_url, "--path-policy", "whole"],
                env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            arms["whole"] = (f"http://127.0.0.1:{whole_port}", {})
            asyncio.run(wait_healthy(arms["whole"][0], children[-1], 120))
            named["whole-router"] = children[-1].pid
        placement = placement_of(named)
        samples: dict[str, list[Sample]] = {arm: [] for arm in arms}
        order = list(arms)
        with httpx.Client(trust_env=False) as client:
            for arm, (base, headers) in arms.items():
                for i in range(2):
                    stream_one(client, base, f"warm up {i} " * 40, 8,
                               f"warm-{arm}-{layout}-{i}-{uuid.uuid4().hex[:6]}", headers)
            for i, prompt in enumerate(prompts[:len(prompts) // len(arms) * len(arms)]):
                rnd, slot = divmod(i, len(arms))
                arm = order[(rnd + slot) % len(arms)]
                base, headers = arms[arm]
                time.sleep(quiet_s)
                samples[arm].append(stream_one(client, base, prompt, max_tokens,
                                               f"b-{arm}-{layout}-{i}-{uuid.uuid4().hex[:8]}",
                                               headers))
        time.sleep(1.0)
        load = os.getloadavg()[:2]
    finally:
        for child in children:
            stop_process(child)
        cluster.stop()
    return [SetupResult(arm, layout, got, placement, load,  # type: ignore[arg-type]
                        read_timelines([router_tl, kv_tl], got) if arm == name else {})
            for arm, got in samples.items()]


def bench_nixl(model: Path, prompts: list[str], max_tokens: int) -> SetupResult | None:
    try:
        import nixl  # noqa: F401
    except ImportError:
        print("nixl not installed (make bench-deps): skipping the NixlConnector setup")
        return None
    from router.state.registry import WorkerRecord, WorkerRegistry

    redis = start_redis()
    procs: list[subprocess.Popen[bytes]] = []
    records = []
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            env = {**vllm_env(1), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                  "kv_buffer_device": "cpu"}
            procs.append(subprocess.Popen(
                vllm_command(str(model), "127.0.0.1", port, SERVED, kv, None), env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            records.append(WorkerRecord(worker_id=f"nixl-{role}", role=role, model=SERVED,
                                        model_path=str(model), http_url=f"http://127.0.0.1:{port}",
                                        engine_id=role, ucx_address="", max_model_len=4096,
                                        started_at=time.time()))
        for proc, rec in zip(procs, records, strict=True):
            asyncio.run(wait_healthy(rec.http_url, proc, 600))

        async def register() -> None:
            reg = WorkerRegistry(redis.url, ttl_s=3600)
            for rec in records:
                await reg.register(rec)
            await reg.close()

        asyncio.run(register())
        router_port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "router.main", "--port",
                                       str(router_port), "--redis-url", redis.url],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        asyncio.run(wait_healthy(f"http://127.0.0.1:{router_port}", procs[-1], 60))
        samples = run_prompts(f"http://127.0.0.1:{router_port}", prompts, max_tokens, "nixl")
        return SetupResult("nixl", "float", samples, {}, os.getloadavg()[:2])  # type: ignore[arg-type]
    finally:
        for proc in procs:
            stop_process(proc)
        redis.stop()


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q, empty=float("nan"))


def summary(result: SetupResult) -> dict[str, float]:
    """Medians over requests (ITL over every gap) in ms."""
    s = result.samples
    gaps = [g for x in s for g in x.gaps]
    return {"ttft_p50_ms": 1e3 * _pct([x.ttft_s for x in s], 50),
            "ttft_p90_ms": 1e3 * _pct([x.ttft_s for x in s], 90),
            "tpot_p50_ms": 1e3 * _pct([x.tpot_s for x in s], 50),
            "itl_p50_ms": 1e3 * _pct(gaps, 50),
            "stall_per_req_ms": 1e3 * statistics.mean(x.stall_s for x in s)}


def print_report(results: list[SetupResult], breakdown: bool) -> dict[str, object]:
    rows = {f"{r.name}/{r.layout}": summary(r) for r in results}
    keys = list(next(iter(rows.values())))
    print(f"\n{'setup/layout':22s} " + " ".join(f"{k:>17s}" for k in keys))
    for name, row in rows.items():
        print(f"{name:22s} " + " ".join(f"{row[k]:17.1f}" for k in keys))
    print("\nwhere each process ran (cores) and the load average (1 min, 5 min) after the run:")
    for r in results:
        where = ", ".join(f"{k}: {v}" for k, v in r.placement.items())
        print(f"  {r.name}/{r.layout:9s} load {r.loadavg[0]:.2f} {r.loadavg[1]:.2f}   {where}")
    verdicts = {}
    for layout in ("isolated", "float", "side-by-side"):
        pd, plain = rows.get(f"pdserve/{layout}"), rows.get(f"plain/{layout}")
        if pd is None or plain is None:
            continue
        v = {"ttft_over_plain_ms": pd["ttft_p50_ms"] - plain["ttft_p50_ms"],
             "tpot_ratio": pd["tpot_p50_ms"] / plain["tpot_p50_ms"],
             "stall_over_plain_ms": pd["stall_per_req_ms"] - plain["stall_per_req_ms"]}
        verdicts[layout] = v
        print(f"\n{layout}: P/D TTFT p50 - plain = {v['ttft_over_plain_ms']:+.1f} ms "
              f"(target <= +50), TPOT p50 ratio {v['tpot_ratio']:.3f} (target <= 1.1), "
              f"stall - plain = {v['stall_over_plain_ms']:+.1f} ms/request (target <= +20)")
    arm = {a: rows.get(f"{a}/side-by-side") for a in ("plain", "decode-direct", "whole", "pdserve")}
    if all(arm.values()):
        tpot = {a: row["tpot_p50_ms"] for a, row in arm.items() if row is not None}
        split = {"engine": tpot["decode-direct"] / tpot["plain"],
                 "relay": tpot["whole"] / tpot["decode-direct"],
                 "pd_path": tpot["pdserve"] / tpot["whole"]}
        verdicts["side-by-side split"] = split
        print("\nside by side, P/D's TPOT over plain's split (TPOT p50 ratios): "
              f"engine with our connector / plain {split['engine']:.3f}, "
              f"relay (router, whole) / direct {split['relay']:.3f}, "
              f"P/D / whole through a router {split['pd_path']:.3f}")
    phases_out: dict[str, dict[str, dict[str, float]]] = {}
    if breakdown:
        for r in results:
            if not r.timeline:
                continue
            per_phase: dict[str, list[float]] = {}
            for request_phases in r.timeline.values():
                for k, seconds in request_phases.items():
                    per_phase.setdefault(k, []).append(seconds)
            print(f"\nphase breakdown, {r.name}/{r.layout} ({len(r.timeline)} requests), ms:")
            print(f"  {'phase':34s} {'p50':>9s} {'p90':>9s} {'n':>4s}")
            stats = {}
            for k, vs in per_phase.items():
                stats[k] = {"p50_ms": 1e3 * _pct(vs, 50), "p90_ms": 1e3 * _pct(vs, 90),
                            "n": len(vs)}
                print(f"  {k:34s} {stats[k]['p50_ms']:9.2f} {stats[k]['p90_ms']:9.2f} "
                      f"{len(vs):4d}")
            phases_out[f"{r.name}/{r.layout}"] = stats
        ttft = {f"{r.name}/{r.layout}": 1e3 * _pct([x.ttft_s for x in r.samples], 50)
                for r in results}
        print("\nclient TTFT p50 per setup (ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in ttft.items()))
    return {"summary": rows, "verdicts": verdicts, "phases": phases_out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd_vs_plain",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--isolate-cores", action="store_true",
                        help="run the isolated layout (default: both layouts)")
    parser.add_argument("--float", dest="floating", action="store_true",
                        help="run the floating layout (default: both layouts)")
    parser.add_argument("--side-by-side", dest="side_by_side", action="store_true",
                        help="run P/D (isolated) and a plain server on the decode's cores at "
                             "once, requests alternating (default: all three layouts)")
    parser.add_argument("--relay-arms", action="store_true",
                        help="side by side: also the decode engine reached directly and a "
                             "second router serving whole requests on it (splits P/D's extra "
                             "TPOT into engine, relay and P/D path)")
    parser.add_argument("--quiet-s", type=float, default=QUIET_S,
                        help="side by side: pause before each request (vLLM's CPU workers "
                             "busy-loop for 1 s after their last step)")
    parser.add_argument("--breakdown", action="store_true",
                        help="print the phase breakdown from the router and connector timelines")
    parser.add_argument("--nixl", action="store_true", help="also run vLLM's NixlConnector")
    parser.add_argument("--classic", action="store_true",
                        help="also run classic P/D (--no-first-token-from-prefill: the decode "
                             "samples the first token again), the behaviour before it")
    parser.add_argument("--kv-transport", default="ucx",
                        help="comma-separated pdserve KV transports to run (ucx, nixl), each a "
                             "setup of its own (pdserve, pdserve-nixl)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    transports = [t for t in args.kv_transport.split(",") if t]
    unknown = set(transports) - set(TRANSPORTS)
    if unknown or not transports:
        parser.error(f"--kv-transport: choose from {list(TRANSPORTS)}, got {args.kv_transport}")
    layouts = [name for name, on in (("isolated", args.isolate_cores), ("float", args.floating),
                                     ("side-by-side", args.side_by_side))
               if on] or ["isolated", "float", "side-by-side"]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    model = build_tiny_model()
    # side by side, each arm gets ``--requests`` of its own (the first ones: those of the
    # other layouts; the synthesizer is seeded)
    arms = 2 + (len(RELAY_ARMS) if args.relay_arms else 0)
    prompts = make_prompts(model, arms * args.requests, args.prompt_tokens)
    cores = sorted(os.sched_getaffinity(0))
    plan = plan_cpus(cores, 2)
    print(f"{len(cores)} cores; isolated layout: {plan.reason}; load average at start "
          f"{os.getloadavg()[0]:.2f}")
    results: list[SetupResult] = []
    with tempfile.TemporaryDirectory(prefix="pd-vs-plain-") as tmp:
        for layout in layouts:
            if layout == "side-by-side":
                for transport in transports:
                    results += bench_side_by_side(model, prompts, args.max_tokens, Path(tmp),
                                                  transport, args.quiet_s, args.relay_arms)
                continue
            own = prompts[:args.requests]
            cpus = plan.slots[0] if layout == "isolated" and plan.isolated else ()
            results.append(bench_plain(model, own, args.max_tokens, layout, cpus))
            for transport in transports:
                results.append(bench_pdserve(model, own, args.max_tokens, layout, Path(tmp),
                                             transport=transport))
            if args.classic:
                results.append(bench_pdserve(model, own, args.max_tokens, layout, Path(tmp),
                                             first_token=False))
    if args.nixl:
        nixl = bench_nixl(model, prompts[:3], args.max_tokens)
        if nixl is not None:
            results.append(nixl)
    report = print_report(results, args.breakdown)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
