"""`pdserve chaos`: faults against a real local cluster under load; proves nothing is lost.

It starts its own `pdserve up` cluster (so it owns every process it kills: real vLLM workers,
real Redis, real UCX), runs an open-loop streaming load (:mod:`serve.chaos.load`), injects
``--faults`` faults cycling through the kinds of :mod:`serve.chaos.faults` with seeded random
timing, and waits for the cluster to be whole again after each (its recovery time). Then it
stops the load and checks that every worker's KV cache and queues drain to 0 within the lease
(no stranded blocks), stops the cluster, and replays every completed prompt on a plain vLLM
server: a completed greedy output that differs is **wrong**.

``--out DIR`` gets ``summary.json`` (faults by kind, requests by outcome, wrong, stranded,
recovery seconds per kind and pool; what the clients saw, in all and per fault kind: failures
among the requests they did not abort, 429s, time to first token; the router's stream moves and
role fallbacks, :mod:`serve.chaos.router_tally`) and ``requests.jsonl``. The exit code is 1
when anything was lost, hung, wrong or stranded, or the cluster did not recover.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from router import settings as shared
from router.samples import total
from router.state.registry import WorkerRegistry
from router.state.worker_load import fetch_samples
from serve.chaos.faults import KINDS, POOL_OF, FaultInjector, Injected
from serve.chaos.load import OUTCOMES, ChaosLoad, LoadConfig, Outcome, prompt_pool
from serve.chaos.router_tally import CounterTally
from serve.plain_vllm import start_plain_vllm
from serve.redis_server import free_port
from serve.supervisor import Cluster, ClusterSettings
from serve.worker import stop_process, wait_healthy

logger = logging.getLogger(__name__)

SERVED_NAME = "tiny-llama"


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    """Flags of `pdserve chaos`."""
    p.add_argument("--faults", type=int, default=100, help="faults to inject (default 100)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated fault kinds (default all: {','.join(KINDS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--model", default=None, help="model dir (default: the tiny offline model)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (open loop)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=24, help="distinct prompts in the load")
    p.add_argument("--prompt-words", type=int, default=120)
    p.add_argument("--deadline-s", type=float, default=120.0,
                   help="a request with no end by then is lost (no head) or hung")
    p.add_argument("--redis-outage-s", type=float, default=10.0)
    p.add_argument("--recover-timeout-s", type=float, default=180.0)
    p.add_argument("--gap-s", type=float, default=2.0,
                   help="mean random pause before each fault (uniform 0.5x..1.5x)")
    p.add_argument("--cpu-layout", choices=["auto", "float"], default="auto")
    p.add_argument("--reference-url", default=None,
                   help="a running plain vLLM server (same model, no connector) whose greedy "
                        "outputs the completed requests must equal (default: start one after "
                        "the run)")
    p.add_argument("--out", default="chaos-out", help="directory for summary.json")


def schedule(kinds: list[str], faults: int, rng: random.Random) -> list[str]:
    """``faults`` kinds: every kind once per round, each round in a seeded random order."""
    out: list[str] = []
    while len(out) < faults:
        round_ = list(kinds)
        rng.shuffle(round_)
        out += round_
    return out[:faults]


async def _health(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        resp = await client.get(url + "/health", timeout=2.0)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def wait_whole(cluster: Cluster, prefill: int, decode: int, timeout_s: float) -> bool:
    """Until the router is up, sees both pools at full size and Redis, and no worker restart
    is pending."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            health = await _health(client, cluster.url)
            running = [w for w in cluster.workers if w.proc.poll() is None]
            if health and health.get("redis") == "ok" and \
                    health.get("prefill_workers") == prefill and \
                    health.get("decode_workers") == decode and \
                    len(running) == prefill + decode:
                return True
            await asyncio.sleep(0.5)
    return False


async def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def stranded_workers(redis_url: str, timeout_s: float) -> dict[str, dict[str, float]]:
    """Workers whose KV usage or queues are not back to 0 within ``timeout_s`` (a leased or
    leaked block keeps ``vllm:kv_cache_usage_perc`` above 0)."""
    registry = WorkerRegistry(redis_url)
    try:
        records = await registry.list()
    finally:
        await registry.close()
    deadline = time.monotonic() + timeout_s
    left: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        while True:
            left = {}
            for r in records:
                try:
                    samples = await fetch_samples(client, r.http_url, 5.0)
                except (httpx.HTTPError, ValueError) as exc:
                    left[r.worker_id] = {"unreachable": 1.0}
                    logger.warning("cannot scrape %s: %s", r.worker_id, exc)
                    continue
                state = {name: total(samples, f"vllm:{name}") for name in
                         ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")}
                if any(state.values()):
                    left[r.worker_id] = state
            if not left or time.monotonic() > deadline:
                return left
            await asyncio.sleep(1.0)


async def references(model: str, prompts: dict[int, str], max_tokens: int,
                     url: str | None = None) -> dict[int, str]:
    """Greedy outputs of a plain vLLM server (no connector) for ``prompts``: the one at ``url``
    (serving ``model`` under the name its ``/v1/models`` gives first), else one started here."""
    proc = None
    if url is None:
        proc, url = start_plain_vllm(model, SERVED_NAME)
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=120.0) as client:
            if proc is not None:
                await wait_healthy(url, proc, 600.0)
                name = SERVED_NAME
            else:
                listed = await client.get(url + "/v1/models")
                listed.raise_for_status()
                name = listed.json()["data"][0]["id"]
            out: dict[int, str] = {}
            for index, prompt in sorted(prompts.items()):
                resp = await client.post(url + "/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True})
                resp.raise_for_status()
                out[index] = resp.json()["choices"][0]["text"]
            return out
    finally:
        if proc is not None:
            await asyncio.to_thread(stop_process, proc)


async def tally_router(url: str, tally: CounterTally, stop: asyncio.Event) -> None:
    """Read the router's fault counters every second until ``stop`` (and once more after)."""
    async with httpx.AsyncClient(trust_env=False) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):  # restarting: next time
                tally.add(await fetch_samples(client, url, 2.0))
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def client_view(faults: list[Injected], outcomes: list[Outcome]) -> dict[str, Any]:
    """What the clients saw: failures among the requests they did not abort themselves, in all
    and per fault kind (a request belongs to the last fault injected before it was sent), with
    the time to first token of the requests sent after each kind of fault."""
    judged = [o for o in outcomes if o.outcome != "aborted"]
    failures = [o for o in judged if o.client_failure]
    ordered = sorted(faults, key=lambda f: f.at)
    per: dict[str, list[Outcome]] = {}
    for o in judged:
        kind = "before_faults"
        for f in ordered:
            if f.at > o.sent_at:
                break
            kind = f.kind
        per.setdefault(kind, []).append(o)
    return {
        "judged": len(judged),
        "failures": len(failures),
        "failure_rate": round(len(failures) / len(judged), 4) if judged else 0.0,
        "overloaded_429": sum(1 for o in judged if o.status == 429),
        "failure_kinds": dict(Counter(o.error.split(":")[0][:60] for o in failures)),
        "by_fault": {kind: {
            "requests": len(group),
            "failures": sum(1 for o in group if o.client_failure),
            "ttft_p50_s": _p50([o.ttft_s for o in group if o.ttft_s is not None]),
            "ttft_max_s": max((round(o.ttft_s, 3) for o in group if o.ttft_s is not None),
                              default=None)}
            for kind, group in sorted(per.items())},
    }


def summarize(faults: list[Injected], outcomes: list[Outcome], wrong: list[Outcome],
              stranded: dict[str, dict[str, float]], restarts: dict[str, int],
              duration_s: float, args: argparse.Namespace,
              router: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The ``summary.json`` document."""
    by_outcome = Counter(o.outcome for o in outcomes)
    recovery: dict[str, list[float]] = {}
    pools: dict[str, list[float]] = {}
    unrecovered = 0
    for f in faults:
        if f.recovered_s is None:
            unrecovered += 1
            continue
        recovery.setdefault(f.kind, []).append(round(f.recovered_s, 2))
        if f.kind in POOL_OF:
            pools.setdefault(POOL_OF[f.kind], []).append(f.recovered_s)
    return {
        "faults": len(faults),
        "faults_by_kind": dict(Counter(f.kind for f in faults)),
        "requests": {"sent": len(outcomes), **{k: by_outcome.get(k, 0) for k in OUTCOMES}},
        "requests_by_behaviour": {b: dict(Counter(o.outcome for o in outcomes
                                                  if o.behaviour == b))
                                  for b in sorted({o.behaviour for o in outcomes})},
        "client": client_view(faults, outcomes),
        "router": router or {},
        "lost": by_outcome.get("lost", 0),
        "hung": by_outcome.get("hung", 0),
        "wrong": len(wrong),
        "checked_outputs": sum(1 for o in outcomes if o.outcome == "completed"),
        "stranded_kv": len(stranded),
        "stranded_workers": stranded,
        "unrecovered_faults": unrecovered,
        "recovery_s_by_kind": {k: {"median": round(statistics.median(v), 2), "max": max(v)}
                               for k, v in sorted(recovery.items())},
        "recovery_s_by_pool": {k: {"median": round(statistics.median(v), 2),
                                   "max": round(max(v), 2)} for k, v in sorted(pools.items())},
        "restarts": restarts,
        "fault_log": [{"kind": f.kind, "at": round(f.at, 3), "victim": f.victim,
                       "recovered_s": None if f.recovered_s is None else round(f.recovered_s, 2)}
                      for f in faults],
        "duration_s": round(duration_s, 1),
        "config": {**{k: getattr(args, k) for k in ("faults", "kinds", "seed", "prefill",
                                                     "decode", "rate", "max_tokens", "deadline_s")},
                   "lease_s": args.kv_lease_s},
    }


async def run_chaos(args: argparse.Namespace) -> int:
    """Run the whole experiment; returns the exit code."""
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"unknown fault kinds {unknown}; allowed: {', '.join(KINDS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    plan = schedule(kinds, args.faults, rng)
    settings = ClusterSettings(model=args.model, served_model_name=SERVED_NAME,
                               prefill=args.prefill, decode=args.decode, port=free_port(),
                               redis_url=f"redis://127.0.0.1:{free_port()}/0",
                               lease_s=args.kv_lease_s, cpu_layout=args.cpu_layout,
                               ready_timeout_s=900.0)
    cluster = Cluster(settings)
    started = time.monotonic()
    cluster.start()  # on this thread: children die with the thread that started them
    stop_supervising = asyncio.Event()

    async def supervise() -> None:
        while not stop_supervising.is_set():
            cluster.supervise()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_supervising.wait(), timeout=0.5)

    supervisor: asyncio.Task[None] | None = None
    faults: list[Injected] = []
    outcomes: list[Outcome] = []
    stranded: dict[str, dict[str, float]] = {}
    tally = CounterTally()
    prompts = prompt_pool(args.prompts, args.prompt_words, args.seed)
    try:
        await cluster.wait_ready()
        assert cluster.model is not None
        supervisor = asyncio.create_task(supervise())
        if not await wait_whole(cluster, args.prefill, args.decode, args.recover_timeout_s):
            raise RuntimeError("the cluster did not come up whole")
        load = ChaosLoad(LoadConfig(cluster.url, SERVED_NAME, prompts, rate_per_s=args.rate,
                                    max_tokens=args.max_tokens, deadline_s=args.deadline_s),
                         random.Random(args.seed + 1))
        stop_load = asyncio.Event()
        load_task = asyncio.create_task(load.run(stop_load))
        tally_task = asyncio.create_task(tally_router(cluster.url, tally, stop_load))
        injector = FaultInjector(cluster, load, rng, lease_s=args.kv_lease_s,
                                 redis_outage_s=args.redis_outage_s)
        await asyncio.sleep(3.0)  # load in flight before the first fault
        for i, kind in enumerate(plan):
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.gap_s)
            fault = await injector.inject(kind)
            if fault.process is not None:  # the cluster must notice before it can recover
                await _wait_exit(fault.process.proc, args.recover_timeout_s)
            whole = await wait_whole(cluster, args.prefill, args.decode, args.recover_timeout_s)
            fault.recovered_s = time.time() - fault.at if whole else None
            faults.append(fault)
            logger.info("fault %d/%d %s: %s", i + 1, len(plan), kind,
                        f"whole again after {fault.recovered_s:.1f} s" if whole
                        else "the cluster did NOT recover")
        await asyncio.sleep(3.0)  # requests sent after the last fault complete too
        stop_load.set()
        await load_task
        await tally_task
        outcomes = load.outcomes
        stranded = await stranded_workers(cluster.redis_url, args.kv_lease_s + 20.0)
    finally:
        stop_supervising.set()
        if supervisor is not None:
            await supervisor  # no restart may race the shutdown below
        await asyncio.to_thread(cluster.stop)
    completed = [o for o in outcomes if o.outcome == "completed"]
    model = cluster.model
    assert model is not None
    refs = await references(model, {o.prompt_index: prompts[o.prompt_index] for o in completed},
                            args.max_tokens, args.reference_url)
    wrong = [o for o in completed if o.text != refs[o.prompt_index]]
    wrong_ids = {o.index for o in wrong}
    summary = summarize(faults, outcomes, wrong, stranded, dict(cluster.restarts),
                        time.monotonic() - started, args, tally.summary())
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out_dir / "requests.jsonl", "w") as fh:
        for o in outcomes:
            fh.write(json.dumps({**o.__dict__, "wrong": o.index in wrong_ids}) + "\n")
    print(json.dumps(summary, indent=2), flush=True)
    bad = summary["lost"] + summary["hung"] + summary["wrong"] + summary["stranded_kv"] + \
        summary["unrecovered_faults"]
    return 1 if bad else 0


def parser() -> argparse.ArgumentParser:
    """Flags of `pdserve chaos` (the log level and KV lease are the shared ``router.settings``;
    the lease defaults shorter here, see its ``OVERRIDES``)."""
    p = argparse.ArgumentParser(prog="pdserve chaos", description=__doc__.split("\n")[0])
    add_chaos_args(p)
    shared.add_arguments(p, "chaos")
    return p


def main(argv: list[str]) -> int:
    """Entry point of `pdserve chaos`."""
    args = parser().parse_args(argv)
    if not shared.resolve_for_cli(args, "chaos", "pdserve chaos"):
        return 2
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from router.main import quiet_http_clients

    quiet_http_clients()
    return asyncio.run(run_chaos(args))
