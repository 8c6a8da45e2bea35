"""The KV pull on a GPU, checked byte for byte and timed against the GPU's own copy (issue 28).

    bash bench/gpu_check.sh [OUT]             # on a bare GPU machine: install, build, run this
    python -m bench.gpu_check --out DIR       # this part alone (the extension already built)

For each variant, two processes (`bench.gpu_pull`): a "prefill" registers paged KV tensors
with the connector's transport and a "decode" pulls block sets into its own tensors through
the connector's code path, checks every byte, and times the pull beside torch copying the same
bytes on the same device (the limit). Variants:
  host          host (CPU) tensors, the connector's defaults (same-host process_vm_readv);
                the reference that also runs where there is no GPU.
  cuda-auto     CUDA tensors, UCX choosing its transports (cuda_ipc expected on one GPU).
  cuda-ipc      CUDA tensors, UCX_TLS=cuda_ipc,cuda_copy,tcp.
  cuda-staged   CUDA tensors without cuda_ipc (UCX_TLS=cuda_copy,tcp): UCX stages the bytes
                through host memory, the path left when IPC between the processes fails.
  cuda-poll     cuda-auto with the progress thread polling instead of sleeping on UCX's event
                fd (PDSERVE_UCX_WAKEUP=0), in case the CUDA transports raise no events.
Each decode runs with UCX_PROTO_INFO=y, and the protocol lines UCX prints (which transport
carried the GETs) go into the JSON; cuda-auto, cuda-ipc and cuda-poll fail unless their
GETs into CUDA memory went by cuda_ipc (`GET_TRANSPORT`), not by message emulation over tcp.
Then the CUDA-specific tests (`tests/gpu`) run under pytest. Everything goes to
`OUT/gpu_check.json` and `OUT/gpu_check.log`; a table is printed.

Exit status: 0 when a GPU was found and every check passed; 3 when there is no CUDA GPU (the
host variant still runs and its bytes are checked); 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.gpu_pull import block_bytes
from bench.kv_transfer_peer import Channel
from bench.metrics import percentile

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = 3
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "host": ("cpu", {}),
    "cuda-auto": ("cuda", {}),
    "cuda-ipc": ("cuda", {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}),
    "cuda-staged": ("cuda", {"UCX_TLS": "cuda_copy,tcp"}),
    "cuda-poll": ("cuda", {"PDSERVE_UCX_WAKEUP": "0"}),
}
"""name -> (device, environment of both sides)."""
PROTO_WORDS = ("cuda_ipc", "cuda_copy", "tcp/", "rndv", "ucp_get", "zero-copy", "copy-in")
GET_TRANSPORT = {"cuda-auto": "cuda_ipc", "cuda-ipc": "cuda_ipc", "cuda-poll": "cuda_ipc"}
"""Variants whose device-to-device GETs must be carried by this UCX transport (every row of the
protocol UCX chose for them names it); a variant whose GETs fell back to active-message
emulation over tcp fails. `cuda-staged` has no expectation: emulation is what it measures."""


def gbps(nbytes: int, seconds: list[float]) -> float:
    """Bytes per second in GB/s at the median time (0 for no times)."""
    median = percentile(seconds, 50, empty=0.0)
    return nbytes / median / 1e9 if median else 0.0


def percentile_us(seconds: list[float], p: float) -> float:
    """The ``p``-th percentile (0..100, as every bench summary takes it) in microseconds."""
    return percentile(seconds, p, empty=0.0) * 1e6


class Side:
    """One `bench.gpu_pull` process, its stderr kept in a file."""

    def __init__(self, role: str, spec: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._err = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_pull"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True,
                                     env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.ch = Channel(self.proc.stdout, self.proc.stdin)
        self.ch.send({**spec, "role": role})

    def recv(self) -> Any:
        """The side's next message; RuntimeError for an error report or a dead side."""
        try:
            msg = self.ch.recv()
        except EOFError as exc:
            raise RuntimeError(f"the side died (exit {self.proc.poll()}); see its log") from exc
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def stop(self) -> None:
        """Kill the process if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._err.close()


def run_variant(name: str, spec: dict[str, Any], logdir: Path,
                timeout_s: float) -> dict[str, Any]:
    """One prefill/decode pair of `name`; the decode's result plus the prefill's verdict, or
    {"error": ...} (a side failed or the pair outran `timeout_s`)."""
    device, env = VARIANTS[name]
    env = {**env, "UCX_PROTO_INFO": "y"} if device == "cuda" else dict(env)
    spec = {**spec, "device": device}
    sides: list[Side] = []

    def kill_all() -> None:
        for side in sides:
            side.proc.kill()

    timer = threading.Timer(timeout_s, kill_all)
    timer.start()
    t0 = time.monotonic()
    try:
        prefill = Side("prefill", spec, env, logdir / f"{name}-prefill.log")
        sides.append(prefill)
        handshake = prefill.recv()
        decode = Side("decode", spec, env, logdir / f"{name}-decode.log")
        sides.append(decode)
        decode.ch.send(handshake)
        result: dict[str, Any] = decode.recv()
        prefill.ch.send("done")
        result.update(prefill.recv())
        result["prefill_memory_types"] = handshake["memory_types"]
    except Exception as exc:  # a variant that fails is reported, the others still run
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        timer.cancel()
        for side in sides:
            side.stop()
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["env"] = env
    if name in GET_TRANSPORT:
        result["expected_get_transport"] = GET_TRANSPORT[name]
    decode_log = logdir / f"{name}-decode.log"
    if decode_log.exists():
        lines = decode_log.read_text(errors="replace").splitlines()
        result["ucx_protocols"] = [ln.strip() for ln in lines
                                   if any(w in ln for w in PROTO_WORDS)][:40]
        result["get_protocols"] = get_protocols(lines)
    return result


def get_protocols(lines: list[str]) -> list[str]:
    """The rows ("description | transport") of every protocol table UCX printed
    (UCX_PROTO_INFO=y) for GETs into CUDA memory, e.g. "zero-copy | cuda_ipc/cuda" or
    "software emulation | tcp/lo"."""
    rows: list[str] = []
    in_table = False
    for line in lines:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1:  # a table's title line
            in_table = "remote memory read by ucp_get" in cells[0] and "into cuda" in cells[0]
        elif in_table and len(cells) >= 3 and cells[0] != "Range":
            rows.append(" | ".join(cells[1:]))
    return rows


def get_transport_ok(result: dict[str, Any]) -> bool:
    """The variant's GETs used the transport `GET_TRANSPORT` expects (True when none is)."""
    want = result.get("expected_get_transport")
    rows = result.get("get_protocols") or []
    return not want or (bool(rows) and all(want in row for row in rows))


def passed(result: dict[str, Any]) -> bool:
    """Every byte check of a variant passed (and it ran), on the expected GET transport."""
    return ("error" not in result and bool(result.get("source_intact"))
            and all(r["ok"] for r in result["rows"]) and bool(result["small"]["ok"])
            and get_transport_ok(result))


def summarize(name: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The variant's table rows: GB/s of our pull and of torch's copy, and their ratio."""
    if "error" in result:
        return []
    rows = []
    for r in result["rows"]:
        ours, limit = gbps(r["bytes"], r["pull_s"]), gbps(r["bytes"], r["torch_s"])
        rows.append({"variant": name, "layout": r["layout"], "mib": r["mib"], "ops": r["ops"],
                     "ok": r["ok"], "ours_gbps": round(ours, 2), "torch_gbps": round(limit, 2),
                     "ours_over_torch": round(ours / limit, 3) if limit else None})
    small = result["small"]
    rows.append({"variant": name, "layout": f"small ({small['blocks']} blocks)",
                 "mib": round(small["bytes"] / 2**20, 2), "ops": small["ops"], "ok": small["ok"],
                 "ours_p50_us": round(percentile_us(small["pull_s"], 50), 1),
                 "ours_p99_us": round(percentile_us(small["pull_s"], 99), 1),
                 "torch_p50_us": round(percentile_us(small["torch_s"], 50), 1),
                 "torch_p99_us": round(percentile_us(small["torch_s"], 99), 1)})
    return rows


def gpu_facts() -> dict[str, Any]:
    """What torch sees: CUDA availability, the GPU's name and memory, versions."""
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda_available":
                             torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if facts["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     gpu_count=torch.cuda.device_count())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=False)
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        facts["nvidia_smi"] = f"unavailable: {exc}"
    return facts


def run_tests(out: Path, native_build: str | None) -> dict[str, Any]:
    """The CUDA-specific connector tests (`tests/gpu`) under pytest, without the suite's
    conftest and settings (the GPU machine has no vLLM); their output goes to the log."""
    env = {**os.environ, "PDSERVE_NATIVE_BUILD": native_build or ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--noconftest",
           "-c", os.devnull, "--rootdir", str(ROOT), str(ROOT / "tests" / "gpu")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    (out / "tests.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return {"rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:],
            "outcomes": [ln for ln in lines if ln.split(" ", 1)[0] in
                         ("PASSED", "FAILED", "SKIPPED", "ERROR")]}


def print_table(rows: list[dict[str, Any]]) -> None:
    """The measured rows as a plain-text table."""
    print(f"{'variant':<12} {'layout':<18} {'MiB':>7} {'ops':>6} {'ok':>3} "
          f"{'ours':>16} {'torch copy':>16} {'ours/torch':>10}")
    for r in rows:
        if "ours_gbps" in r:
            ours, limit = f"{r['ours_gbps']:.2f} GB/s", f"{r['torch_gbps']:.2f} GB/s"
            ratio = f"{r['ours_over_torch']:.3f}" if r["ours_over_torch"] is not None else "-"
        else:
            ours = f"p50 {r['ours_p50_us']:.0f} us"
            limit = f"p50 {r['torch_p50_us']:.0f} us"
            ratio = f"p99 {r['ours_p99_us']:.0f}/{r['torch_p99_us']:.0f}"
        print(f"{r['variant']:<12} {r['layout']:<18} {r['mib']:>7} {r['ops']:>6} "
              f"{'yes' if r['ok'] else 'NO':>3} {ours:>16} {limit:>16} {ratio:>10}")


def main(argv: list[str] | None = None) -> int:
    """Run the variants and the GPU tests, write the JSON and print the table; the exit status
    is 0, NO_GPU or 1 as the module docstring says."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and logs")
    parser.add_argument("--native-build", default=os.environ.get("PDSERVE_NATIVE_BUILD") or None,
                        help="folder of the built extension (default: the package's)")
    parser.add_argument("--sizes-mib", default="1,4,16,64,256,1024",
                        help="pull sizes on the GPU, MiB")
    parser.add_argument("--host-sizes-mib", default="1,4,16,64",
                        help="pull sizes of the host variant, MiB")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per size")
    parser.add_argument("--small-repeats", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"which of {list(VARIANTS)}")
    parser.add_argument("--variant-timeout-s", type=float, default=90.0,
                        help="a variant's pair is killed after this long")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="variants that could end past this many seconds are not started")
    parser.add_argument("--slow-pull-s", type=float, default=2.0,
                        help="larger sizes are skipped once a pull took this long")
    parser.add_argument("--no-tests", action="store_true", help="skip tests/gpu")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = gpu_facts()
    report: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0],
                              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "loadavg": os.getloadavg(), "cpus": os.cpu_count(), **facts}
    print(json.dumps(facts), flush=True)
    results: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in [v for v in args.variants.split(",") if v]:
            device = VARIANTS[name][0]
            if device == "cuda" and not facts["cuda_available"]:
                results[name] = {"error": "no CUDA GPU: torch.cuda.is_available() is False"}
                continue
            if time.monotonic() - started + args.variant_timeout_s > args.budget_s:
                results[name] = {"error": f"not started: the {args.budget_s:.0f} s budget"}
                continue
            sizes = args.sizes_mib if device == "cuda" else args.host_sizes_mib
            mibs = [int(s) for s in sizes.split(",")]
            per_block = 2 * args.layers * block_bytes()
            spec = {"layers": args.layers, "sizes_mib": mibs, "seed": 1234,
                    "num_blocks": max(64, 2 * max(mibs) * 2**20 // per_block),
                    "layouts": ["contiguous", "scattered"], "repeats": args.repeats,
                    "small_repeats": args.small_repeats, "pull_timeout_s": 30.0,
                    "slow_pull_s": args.slow_pull_s,
                    "native_build": args.native_build}
            print(f"== {name}", flush=True)
            results[name] = run_variant(name, spec, Path(tmp), args.variant_timeout_s)
            rows += summarize(name, results[name])
            if "error" in results[name]:
                print(f"   failed: {results[name]['error']}", flush=True)
            with (args.out / "gpu_check.log").open("a") as log:
                for side in ("prefill", "decode"):
                    path = Path(tmp) / f"{name}-{side}.log"
                    if path.exists():
                        log.write(f"===== {name} {side}\n{path.read_text(errors='replace')}\n")
    report["variants"] = results
    report["table"] = rows
    if not args.no_tests:
        report["tests"] = run_tests(args.out, args.native_build)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print_table(rows)
    failed = [n for n, r in results.items()
              if not passed(r) and not (VARIANTS[n][0] == "cuda" and not facts["cuda_available"])]
    tests_failed = bool(report.get("tests")) and report["tests"]["rc"] not in (0, 5)
    for n, r in results.items():
        if r.get("get_protocols"):
            print(f"{n}: GETs into CUDA memory by {'; '.join(sorted(set(r['get_protocols'])))}")
    for n in failed:
        why = results[n].get("error") or ("a byte check failed" if get_transport_ok(results[n])
                                          else f"GETs not carried by {GET_TRANSPORT[n]}")
        print(f"FAILED: {n}: {why}")
    if tests_failed:
        print(f"FAILED: tests/gpu: {report['tests']['summary']}")
    if not facts["cuda_available"]:
        print("NO GPU: torch.cuda.is_available() is False; only the host variant ran "
              f"({'passed' if 'host' in results and passed(results['host']) else 'not passed'})")
        return 1 if failed or tests_failed else NO_GPU
    return 1 if failed or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
