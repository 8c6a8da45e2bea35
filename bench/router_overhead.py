"""What a router adds to a request: direct vs pdserve's router vs vllm-router, in one run.

    python -m bench.router_overhead [--rate 100 --rate 300 --rate 600] [--duration-s 20]

A fast fake vLLM backend (``bench.fake_openai``: 16-token SSE streams in vLLM's exact shape)
is called directly and through each router (``bench.overhead_stack``: pdserve's router with the
backend registered in Redis as an aggregated worker, vllm-router with ``--policy
round_robin``). At each rate an open-loop Poisson client (``bench.lean_client``) sends the same
schedule to every setup, the setups alternating in ``--rounds`` slices of the point's duration
(the order rotating each round), and records each request's time to first text and to last
byte. The table (``bench.overhead_stats``) gives per setup and rate: the achieved send rate,
latency percentiles, the p50/p99 a router adds over the direct setup at the same rate, the
router's CPU per request (its ``/proc`` utime + stime), errors, the client's send lag, the
share of the machine's CPU other user processes used meanwhile, and the load average.

Layout (``--client-cpu``, ``--backend-cpu``, ``--router-cpu``): the client, the backend and
Redis on core 0, the router under test on core 1 (both routers run throughout; the idle one
only polls). pdserve's router tokenizes prompts with the model's tokenizer as in production:
the backend registers the tiny model's directory (``--model-path``) as its weights.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import box_speed
from bench.fake_openai import event_loop_runner
from bench.lean_client import LeanClient, Timing, http_request
from bench.overhead_stack import Layout, Stack, start
from bench.overhead_stats import (
    Point,
    others_ticks,
    poisson_offsets,
    process_cpu_ticks,
    table,
    user_processes_ticks,
)

SETUPS = ("direct", "pdserve", "pdserve-base", "vllm-router")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
BASE_PROMPT = ("Summarise the following notes on disaggregated serving, where prefill and "
               "decode run on separate engines and the KV cache moves between them. ")


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _cpu_ticks(pids: Sequence[int]) -> dict[int, int]:
    return {pid: process_cpu_ticks(_read(f"/proc/{pid}/stat")) for pid in pids}


def _all_stats() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                out[int(name)] = _read(f"/proc/{name}/stat")
    return out


def request_bodies(endpoint: str, model: str, n: int, *, prompt_chars: int,
                   tokens: int) -> list[bytes]:
    """``n`` distinct streamed requests of about ``prompt_chars`` characters each."""
    filler = (BASE_PROMPT * (1 + prompt_chars // len(BASE_PROMPT)))[:prompt_chars]
    out = []
    for i in range(n):
        prompt = f"Request {i}. {filler}"
        body: dict[str, object] = {"model": model, "max_tokens": tokens, "stream": True,
                                   "stream_options": {"include_usage": True},
                                   "temperature": 0.0, "ignore_eos": True}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        out.append(json.dumps(body).encode())
    return out


@dataclass(frozen=True)
class Slice:
    """One setup's run of one schedule."""

    timings: list[Timing]
    span_s: float
    """From the start to the last send."""
    elapsed_s: float
    """From the start to the last answer."""
    router_cpu_s: float | None
    foreign_cpu_s: float
    """CPU other user processes took meanwhile."""


class Bench:
    """Runs the points on a started :class:`Stack`."""

    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack = stack
        self.args = args
        self.path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        self.ours = [os.getpid(), *stack.pids.values()]

    async def run(self, setup: str, offsets: Sequence[float]) -> Slice:
        """One slice of one setup: the schedule ``offsets`` sent to it."""
        url = self.stack.urls[setup]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        bodies = request_bodies(self.args.endpoint, self.stack.model, len(offsets),
                                prompt_chars=self.args.prompt_chars, tokens=self.args.tokens)
        requests = [http_request(host, int(port), self.path, b) for b in bodies]
        client = LeanClient(host, int(port))
        before = _cpu_ticks(self.ours)
        others0 = user_processes_ticks(_all_stats(), self.ours)
        t0 = time.perf_counter()
        try:
            timings = await client.run(requests, offsets, stream=True, tokens=self.args.tokens)
        finally:
            client.close()
        elapsed = time.perf_counter() - t0
        after = _cpu_ticks(self.ours)
        others1 = user_processes_ticks(_all_stats(), self.ours)
        spent = {pid: after[pid] - before[pid] for pid in before}
        errors = Counter(t.error for t in timings if not t.ok)
        if errors:
            print(f"{setup}: {sum(errors.values())} errors: {dict(errors.most_common(3))}",
                  file=sys.stderr)
        router = self.stack.pids.get(setup)
        foreign = others_ticks(others0, others1) / TICKS_PER_S
        return Slice(timings, max((t.scheduled_s + t.lag_s for t in timings), default=0.0),
                     elapsed, None if router is None else spent[router] / TICKS_PER_S, foreign)

    async def point(self, rate: float, order: Sequence[str]) -> list[Point]:
        """Every setup at ``rate``: ``rounds`` slices each, alternating."""
        rounds = self.args.rounds
        got: dict[str, list[Slice]] = {s: [] for s in order}
        for r in range(rounds):
            offsets = poisson_offsets(rate, self.args.duration_s / rounds,
                                      seed=int(rate) * 1000 + r)
            for setup in [*order[r % len(order):], *order[:r % len(order)]]:
                got[setup].append(await self.run(setup, offsets))
                await asyncio.sleep(0.3)  # let the last connections close
        points = []
        n_cores = os.cpu_count() or 1
        for setup, slices in got.items():
            cpu = [s.router_cpu_s for s in slices if s.router_cpu_s is not None]
            points.append(Point(
                setup, rate, sum(s.span_s for s in slices),
                tuple(t for s in slices for t in s.timings), sum(cpu) if cpu else None,
                sum(s.foreign_cpu_s for s in slices) / (sum(s.elapsed_s for s in slices)
                                                        * n_cores),
                os.getloadavg()[0]))
        return points

    async def all(self) -> list[Point]:
        order = [s for s in SETUPS if s in self.stack.urls and s in self.args.setups]
        for setup in order:  # warm-up: connections, tokenizer, caches
            await self.run(setup, poisson_offsets(100.0, 2.0, seed=1))
        points: list[Point] = []
        for rate in self.args.rate:
            got = await self.point(rate, order)
            points += got
            print(table(got).split("\n", 2)[2], flush=True)
        return points


def _ps() -> str:
    out = subprocess.run(["ps", "aux", "--sort=-%cpu"], capture_output=True, text=True,
                         check=False).stdout
    return "\n".join(out.splitlines()[:8])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router_overhead",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rate", type=float, action="append",
                    help="target req/s, repeatable (default 100, 300, 600)")
    ap.add_argument("--duration-s", type=float, default=20.0,
                    help="seconds of each setup at each rate, all rounds together")
    ap.add_argument("--rounds", type=int, default=2,
                    help="slices each point is split in, the setups alternating")
    ap.add_argument("--setup", dest="setups", action="append", choices=SETUPS,
                    help="setups to run, repeatable (default all three)")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--tokens", type=int, default=16, help="streamed tokens per request")
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--chunk-gap-ms", type=float, default=0.0,
                    help="the backend's pause before each event (0: back to back)")
    ap.add_argument("--model", default="fake")
    ap.add_argument("--model-path", help="the weights directory the backend registers (its "
                    "tokenizer is what pdserve's router loads; default: the tiny model)")
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--backend-cpu", type=int, default=0)
    ap.add_argument("--router-cpu", type=int, default=1)
    ap.add_argument("--baseline-tree", type=Path,
                    help="also run pdserve's router from this source tree (setup pdserve-base: "
                    "e.g. `git archive <commit>` unpacked), for before/after in one run")
    ap.add_argument("--pdserve-arg", action="append", default=[],
                    help="an extra flag for pdserve's router (repeatable)")
    ap.add_argument("--out", type=Path, help="write the points as JSON here")
    args = ap.parse_args(argv)
    args.rate = args.rate or [100.0, 300.0, 600.0]
    args.setups = args.setups or [s for s in SETUPS
                                  if s != "pdserve-base" or args.baseline_tree is not None]
    if "direct" not in args.setups:
        args.setups.insert(0, "direct")
    if args.model_path is None:
        from serve.tiny_model import build_tiny_model

        args.model_path = str(build_tiny_model())
    layout = Layout((args.client_cpu,), (args.backend_cpu,), (args.router_cpu,))
    os.sched_setaffinity(0, layout.client_cpus)
    print(f"layout: {layout.describe()}; {args.tokens}-token {args.endpoint} streams, "
          f"{args.prompt_chars}-character prompts, Poisson arrivals, {args.duration_s:g} s per "
          f"point in {args.rounds} alternating rounds; model path {args.model_path}")
    print(f"before: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; box "
          f"{box_speed.measure().line()}\n{_ps()}", flush=True)
    stack = start(layout, model=args.model, model_path=args.model_path, setups=args.setups,
                  chunk_gap_ms=args.chunk_gap_ms, pdserve_args=args.pdserve_arg,
                  baseline_tree=args.baseline_tree)
    try:
        print(table([]), flush=True)
        points = event_loop_runner()(Bench(stack, args).all())
    finally:
        stack.stop()
    print(f"\n{table(points)}")
    print(f"\nafter: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; box "
          f"{box_speed.measure().line()}\n{_ps()}")
    if args.out is not None:
        args.out.write_text(json.dumps([{
            "setup": p.setup, "rate_rps": p.rate_rps, "sent_rps": p.sent_rps,
            "p50_ms": p.latency_ms(50), "p90_ms": p.latency_ms(90), "p99_ms": p.latency_ms(99),
            "ttft_p50_ms": p.ttft_ms(50), "router_cpu_ms_per_request":
                p.router_cpu_ms_per_request, "errors": p.errors,
            "foreign_cpu_share": p.foreign_cpu_share, "load1": p.load1} for p in points],
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
