"""Goodput head-to-head: the highest request rate each setup serves at >= 90 % SLO attainment.

    python -m bench.pd_goodput [--duration 120] [--rates 4,8,12,16,24] [--ttft-slo-s 1.0]
                               [--tpot-slo-s 0.05] [--out DIR]

One BurstGPT-shaped trace with long prompts (``pdserve bench synth``: median 1,000 prompt tokens,
64 output tokens) is swept (``pdserve bench sweep``) on this machine against, in turn:

  (a) pd          ``pdserve up``: 1 prefill + 1 decode (each engine on its own cores);
  (b) aggregated  ``pdserve up --mode aggregated --replicas 2``: 2 plain vLLM workers behind the
                  same router and policies;
  (c) plain       one plain vLLM server (``pdserve worker --role aggregated``, no router);
  (d) selective   (a) with ``--disagg-min-prefill-tokens`` (short or decode-cached prompts skip
                  the prefill hop).

Every setup is started through the ``pdserve`` CLI, swept alone, and stopped before the next.
Each setup first serves a discarded warm-up replay. The table prints the highest passing rate,
attainment at each rate tried, where each process ran and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.placement import children, placement_of

SETUPS = ("pd", "aggregated", "plain", "selective")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "serve.cli", *args]


def _wait(url: str, proc: subprocess.Popen[bytes], workers: dict[str, int],
          timeout_s: float = 900.0) -> None:
    """Until ``url``/health answers 200 with at least ``workers`` (e.g. ``aggregated_workers``
    2) registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            resp = httpx.get(f"{url}/health", timeout=2)
            if resp.status_code == 200 and all(resp.json().get(k, 0) >= n
                                               for k, n in workers.items()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready in {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start(setup: str, min_prefill_tokens: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``setup`` through the pdserve CLI; returns (process group leader, base URL)."""
    port = _free_port()
    redis = f"redis://127.0.0.1:{_free_port()}/0"
    common = ["--port", str(port), "--redis-url", redis, "--served-model-name", "tiny-llama"]
    if setup == "pd":
        cmd = _pdserve("up", *common)
    elif setup == "selective":
        cmd = _pdserve("up", *common,
                       f"--router-arg=--disagg-min-prefill-tokens={min_prefill_tokens}")
    elif setup == "aggregated":
        cmd = _pdserve("up", *common, "--mode", "aggregated", "--replicas", "2")
    else:
        cmd = _pdserve("worker", "--role", "aggregated", "--port", str(port),
                       "--served-model-name", "tiny-llama")
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, {"aggregated_workers": 2} if setup == "aggregated" else {})
    return proc, url


def warm_up(url: str, trace: Path, out: Path, args: argparse.Namespace) -> None:
    """A discarded replay of the trace's first requests: every setup meets the sweep warm
    (tokenizer loaded, vLLM's first long-prompt shapes compiled, connections open)."""
    subprocess.run(_pdserve("bench", "replay", "--url", url, "--trace", str(trace), "--rate",
                            "1", "--max-requests", str(args.warmup_requests), "--out", str(out),
                            "--no-progress", "--no-plots", "--no-sessions"),
                   check=True, stdout=subprocess.DEVNULL)


def sweep(url: str, trace: Path, out: Path, args: argparse.Namespace) -> dict[str, object]:
    cmd = _pdserve("bench", "sweep", "--url", url, "--trace", str(trace), "--rates", args.rates,
                   "--ttft-slo-s", str(args.slo_ttft), "--tpot-slo-s", str(args.slo_tpot),
                   "--bisect-steps", str(args.bisect_steps), "--out", str(out),
                   "--no-progress", "--no-plots", "--no-sessions")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "sweep.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd_goodput",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--duration", type=float, default=120.0, help="trace seconds at 1 req/s")
    parser.add_argument("--rates", default="4,8,12,16,24", help="req/s tried in ascending order")
    parser.add_argument("--bisect-steps", type=int, default=2)
    # The shared spelling (router.settings); --slo-ttft/--slo-tpot kept as aliases.
    parser.add_argument("--ttft-slo-s", "--slo-ttft", dest="slo_ttft", type=float, default=1.0)
    parser.add_argument("--tpot-slo-s", "--slo-tpot", dest="slo_tpot", type=float, default=0.05)
    parser.add_argument("--prompt-median", type=float, default=1000.0)
    parser.add_argument("--response-median", type=float, default=64.0)
    parser.add_argument("--min-prefill-tokens", type=int, default=512,
                        help="selective disaggregation threshold of setup (d)")
    parser.add_argument("--warmup-requests", type=int, default=20,
                        help="requests replayed (and discarded) before each sweep; 0 = none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pd-goodput-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.csv"
    subprocess.run(_pdserve("bench", "synth", "--out", str(trace), "--duration",
                            str(args.duration), "--rate", "1", "--prompt-median",
                            str(args.prompt_median), "--response-median",
                            str(args.response_median), "--max-prompt-tokens", "2500",
                            "--max-response-tokens", "192", "--conversation-fraction", "0",
                            "--seed", str(args.seed)), check=True, stdout=subprocess.DEVNULL)
    results: dict[str, dict[str, object]] = {}
    for setup in [s for s in args.setups.split(",") if s]:
        if setup not in SETUPS:
            raise SystemExit(f"unknown setup {setup!r}; allowed: {', '.join(SETUPS)}")
        load0 = os.getloadavg()[0]
        proc, url = start(setup, args.min_prefill_tokens)
        try:
            layout = " ".join(f"{name}:{cores}" for name, cores in
                              placement_of(children(proc.pid)).items())
            if args.warmup_requests:
                warm_up(url, trace, out / f"{setup}-warmup", args)
            doc = sweep(url, trace, out / setup, args)
            paths = {}
            if setup in ("pd", "selective", "aggregated"):
                text = httpx.get(f"{url}/metrics", timeout=10).text
                for m in re.finditer(r'pdserve_router_paths_total\{path="(\w+)",reason="(\w+)"\}'
                                     r" (\S+)", text):
                    paths[f"{m[1]}/{m[2]}"] = float(m[3])
        finally:
            _stop(proc)
        results[setup] = {"max_rate_rps": doc["max_rate_rps"], "points": doc["points"],
                          "layout": layout, "load_before": load0,
                          "load_after": os.getloadavg()[0], "paths": paths}
        print(f"{setup:11s} max rate at >= 90% attainment: {doc['max_rate_rps']} req/s  "
              f"(load {load0:.2f} -> {os.getloadavg()[0]:.2f}; {layout})", flush=True)
    print(f"\ntrace: {trace} ({args.duration:.0f} s, prompt median {args.prompt_median:.0f}, "
          f"output median {args.response_median:.0f}); SLO TTFT {args.slo_ttft} s, "
          f"TPOT {args.slo_tpot} s")
    print(f"\n{'setup':11s} {'max req/s':>10s}   attainment by rate")
    for setup, r in results.items():
        points: list[dict[str, float]] = r["points"]  # type: ignore[assignment]
        pts = sorted(points, key=lambda p: p["rate"])
        cells = " ".join(f"{p['rate']:g}:{p['slo_attainment']:.2f}" for p in pts)
        print(f"{setup:11s} {r['max_rate_rps']!s:>10s}   {cells}")
        if r["paths"]:
            print(f"{'':11s} {'':>10s}   paths: {r['paths']}")
    (out / "goodput.json").write_text(json.dumps(results, indent=2))
    print(f"\nwritten: {out / 'goodput.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
