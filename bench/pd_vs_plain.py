"""End-to-end latency: one plain vLLM server vs pdserve P/D vs vLLM's NixlConnector P/D.

    python bench/pd_vs_plain.py [--prompts 12] [--max-tokens 64] [--nixl-prompts 3]

The same prompts (1 to ~1,500 tokens, greedy, ``ignore_eos`` so every request makes
``--max-tokens`` tokens) are streamed one at a time through each setup, started and stopped in
turn on this machine:

  plain   one vLLM OpenAI server, no connector (the anchor);
  pdserve ``pdserve up``: router + 1 prefill + 1 decode, KV pulled over UCX;
  nixl    two vLLM servers with ``NixlConnector`` (``kv_buffer_device=cpu``) behind the same
          router (the router's two-step flow is the one vLLM's toy proxy uses).

TTFT is the time to the first streamed token; TPOT is (last token - first token) / (n - 1).
NIXL decode is known to be slow on CPU, so it runs only the first ``--nixl-prompts`` prompts
(ratios against it use that subset). Needs NIXL for the third setup (``make bench-deps``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

if __package__ in (None, ""):
    # Run as a script, sys.path[0] is bench/, whose trace.py and profile.py would shadow the
    # standard library's modules of those names: put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from serve.redis_server import free_port, start_redis  # noqa: E402
from serve.tiny_model import build_tiny_model  # noqa: E402
from serve.worker import stop_process, vllm_command, vllm_env, wait_healthy  # noqa: E402

SERVED = "tiny-llama"
LENGTHS = [1, 16, 64, 128, 256, 400, 512, 700, 1000, 1200, 1500]


@dataclass
class Sample:
    """One streamed request."""

    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    tokens: int


def make_prompts(model_dir: Path, n: int) -> list[str]:
    """Prompts of exactly ``LENGTHS`` tokens (cycled), from the load tester's synthesizer."""
    from bench.prompts import PromptSynthesizer, load_tokenizer

    synth = PromptSynthesizer(load_tokenizer(str(model_dir)), seed=0, sessions=False)
    return [synth.prompt(LENGTHS[i % len(LENGTHS)]).text for i in range(n)]


def stream_one(base: str, prompt: str, max_tokens: int) -> Sample:
    """Stream one completion and time its tokens."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    n = max(1, len(stamps))
    tpot = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0
    return Sample(int(usage.get("prompt_tokens", 0)), stamps[0] - t0, tpot, n)


def run_prompts(base: str, prompts: list[str], max_tokens: int) -> list[Sample]:
    stream_one(base, "warm up", 4)
    return [stream_one(base, p, max_tokens) for p in prompts]


def bench_plain(model: Path, prompts: list[str], max_tokens: int) -> list[Sample]:
    port = free_port()
    proc = subprocess.Popen(vllm_command(str(model), "127.0.0.1", port, SERVED, None, None),
                            env=vllm_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}", proc, 600))
        return run_prompts(f"http://127.0.0.1:{port}", prompts, max_tokens)
    finally:
        stop_process(proc)


def bench_pdserve(model: Path, prompts: list[str], max_tokens: int) -> list[Sample]:
    from serve.supervisor import Cluster, ClusterSettings

    settings = ClusterSettings(model=str(model), served_model_name=SERVED, port=free_port(),
                               redis_url=f"redis://127.0.0.1:{free_port()}/0")
    cluster = Cluster(settings)
    cluster.start()
    try:
        asyncio.run(cluster.wait_ready())
        return run_prompts(cluster.url, prompts, max_tokens)
    finally:
        cluster.stop()


def bench_nixl(model: Path, prompts: list[str], max_tokens: int) -> list[Sample] | None:
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
                                       str(router_port), "--redis", redis.url],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        asyncio.run(wait_healthy(f"http://127.0.0.1:{router_port}", procs[-1], 60))
        return run_prompts(f"http://127.0.0.1:{router_port}", prompts, max_tokens)
    finally:
        for proc in procs:
            stop_process(proc)
        redis.stop()


def median(samples: list[Sample], attr: str) -> float:
    return statistics.median(getattr(s, attr) for s in samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=len(LENGTHS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--nixl-prompts", type=int, default=3)
    parser.add_argument("--no-nixl", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    model = build_tiny_model()
    prompts = make_prompts(model, args.prompts)
    results = {"plain": bench_plain(model, prompts, args.max_tokens),
               "pdserve": bench_pdserve(model, prompts, args.max_tokens)}
    if not args.no_nixl:
        nixl = bench_nixl(model, prompts[:args.nixl_prompts], args.max_tokens)
        if nixl is not None:
            results["nixl"] = nixl

    print(f"\n{'prompt tokens':>13} | " + " | ".join(f"{k:>22}" for k in results))
    print(f"{'':>13} | " + " | ".join(f"{'TTFT ms':>10} {'TPOT ms':>11}" for _ in results))
    for i in range(len(prompts)):
        cells = []
        for samples in results.values():
            s = samples[i] if i < len(samples) else None
            cells.append(f"{s.ttft_s * 1e3:>10.1f} {s.tpot_s * 1e3:>11.2f}" if s else " " * 22)
        print(f"{results['plain'][i].prompt_tokens:>13} | " + " | ".join(cells))
    plain, ours = results["plain"], results["pdserve"]
    print("\nmedians (all prompts):")
    for name, samples in results.items():
        print(f"  {name:8s} TTFT {median(samples, 'ttft_s') * 1e3:8.1f} ms   "
              f"TPOT {median(samples, 'tpot_s') * 1e3:7.2f} ms   (n={len(samples)})")
    print(f"  pdserve/plain TPOT ratio: {median(ours, 'tpot_s') / median(plain, 'tpot_s'):.3f} "
          "(target <= 1.2)")
    k = min(range(len(plain)), key=lambda j: abs(plain[j].prompt_tokens - 1000))
    print(f"  TTFT overhead at {plain[k].prompt_tokens} prompt tokens: "
          f"{(ours[k].ttft_s - plain[k].ttft_s) * 1e3:+.1f} ms (target < 50 ms)")
    if "nixl" in results:
        n = len(results["nixl"])
        sub = {name: samples[:n] for name, samples in results.items()}
        print(f"  on the first {n} prompts: nixl/pdserve TPOT ratio "
              f"{median(sub['nixl'], 'tpot_s') / median(sub['pdserve'], 'tpot_s'):.1f}x, "
              f"TTFT ratio {median(sub['nixl'], 'ttft_s') / median(sub['pdserve'], 'ttft_s'):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
