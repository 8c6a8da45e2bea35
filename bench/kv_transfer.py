"""KV-shaped pull benchmark on one wire: our transport vs NIXL READ vs a single-thread memcpy.

    python -m bench.kv_transfer --wire tcp --mib 64 --json out.json

Wires (`--wire`, comma-separated):
  same-host  both processes on this host and pid namespace: ours reads with process_vm_readv
             (its same-host path), NIXL uses UCX's default transports (cma/shared memory).
  default    both processes on this host, each on UCX with its default transports (ours with
             the same-host path off): what each picks as its best UCX lanes.
  tcp        the cross-host analog: server and client in their own network and pid namespaces
             joined by a veth pair (bench/netns.py; needs root), UCX_TLS=tcp for both, so no
             shared memory, cma or process_vm_readv can apply.

Layout: `--layers` registered regions per side (one per layer, like vLLM's per-layer KV tensors),
each split into K and V halves of `num_blocks` blocks of `--block-kib`. The client pulls `--mib`
MiB: a random permutation of prefill block ids built from contiguous runs (1..8 blocks), for every
layer and K/V half, into consecutive local blocks; runs contiguous on both sides are coalesced into
one op, as the connector does. Both backends pull exactly the same (local, remote, length) list;
the memcpy baseline copies the same number of bytes in this process with one numpy copy. Figures
are medians over `--repeats` timed pulls after one warm-up pull whose bytes are checked. The small
pull is `--small-blocks` scattered blocks per layer and K/V half (one op each), timed
`--small-repeats` times: p50/p99 microseconds.

On `default` and `tcp` the sealed tcp transport (`--kv-transport tcp`: authenticated
connection, server-checked pulls; no same-host path) pulls the same list too (`--no-sealed`
skips it); its server listens on the server side's address.

Each figure is printed with the load average and the cores each process may run on
(bench/placement.py); the JSON (`--json PATH`) holds, per wire, ours_gbps, nixl_gbps,
memcpy_gbps, ratio_vs_nixl, ratio_vs_memcpy, message_bytes, the block geometry and the small-pull
percentiles.

Parameters (defaults): --wire same-host,default,tcp, --mib 256, --block-kib 32, --layers 16,
--repeats 7, --small-blocks 16, --small-repeats 200, --ours-env/--nixl-env K=V (extra
environment of that backend's processes, for tuning), --ours-opt K=V (UcxEngine arguments),
--ours-build DIR (another UCX build of ours), --no-nixl, --pin (server on core 0,
client on core 1).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.kv_transfer_peer import Channel
from bench.metrics import distribution
from bench.netns import Host, host_pair
from bench.placement import placement_of

logger = logging.getLogger("bench.kv_transfer")

ROOT = Path(__file__).resolve().parent.parent
WIRES = ("same-host", "default", "tcp")

# Per wire: (our client's UcxEngine keyword arguments, our environment, NIXL's environment,
# namespaced). On `default` only the client turns its same-host path off: the server still
# advertises its locality, from which the client learns that the peer shares its kernel (so its
# data endpoint may use cma, see kernels/native/ucxrma.h).
WIRE_SETUP: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, str], bool]] = {
    "same-host": ({}, {}, {}, False),
    "default": ({"same_host": False}, {}, {}, False),
    "tcp": ({}, {"UCX_TLS": "tcp"}, {"UCX_TLS": "tcp"}, True),
}
EXPECTED_PATH = {"same-host": "pvm", "default": "ucx", "tcp": "ucx"}
SEALED_WIRES = ("default", "tcp")
"""Wires the sealed tcp transport is measured on too (on `default` it runs over loopback; it
has no same-host path, so `same-host` would measure the same)."""


@dataclass(frozen=True)
class Layout:
    """Sizes shared by both processes."""

    layers: int
    block: int
    blocks_per_half: int  # prefill side: blocks per K (or V) half of a layer
    pulled_per_half: int  # blocks pulled per K (or V) half

    @property
    def region_bytes(self) -> int:
        return 2 * self.blocks_per_half * self.block

    @property
    def local_region_bytes(self) -> int:
        return 2 * self.pulled_per_half * self.block

    @property
    def total_pulled(self) -> int:
        return self.layers * 2 * self.pulled_per_half * self.block


def make_layout(mib: int, block_kib: int, layers: int) -> Layout:
    block = block_kib << 10
    pulled = (mib << 20) // (layers * 2 * block)
    if pulled < 1:
        raise SystemExit("--mib too small for this many layers")
    return Layout(layers, block, 2 * pulled, pulled)


def block_ids(layout: Layout, seed: int = 0) -> np.ndarray:
    """Remote block ids pulled per half: shuffled runs of 1..8 contiguous blocks."""
    rng = np.random.default_rng(seed)
    runs: list[list[int]] = []
    b = 0
    while b < layout.blocks_per_half:
        n = int(rng.integers(1, 9))
        runs.append(list(range(b, min(b + n, layout.blocks_per_half))))
        b += n
    order = rng.permutation(len(runs))
    ids = [i for k in order for i in runs[k]]
    return np.array(ids[: layout.pulled_per_half], dtype=np.int64)


def build_runs(layout: Layout, ids: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(layer, local_offset, remote_offset, nbytes) per coalesced run."""
    out = []
    for layer in range(layout.layers):
        for half in range(2):
            lbase = half * layout.pulled_per_half * layout.block
            rbase = half * layout.blocks_per_half * layout.block
            i = 0
            while i < len(ids):
                j = i + 1
                while j < len(ids) and ids[j] == ids[j - 1] + 1:
                    j += 1
                out.append((layer, lbase + i * layout.block, rbase + int(ids[i]) * layout.block,
                            (j - i) * layout.block))
                i = j
    return out


def small_block_ids(layout: Layout, n: int, seed: int = 1) -> np.ndarray:
    """`n` distinct remote block ids, no two adjacent (one op per block)."""
    rng = np.random.default_rng(seed)
    evens = rng.permutation(layout.blocks_per_half // 2)[:n] * 2
    return evens.astype(np.int64)


@dataclass
class Side:
    """One running side process and its control channel."""

    proc: subprocess.Popen[str]
    ch: Channel

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _start(backend: str, role: str, spec: dict[str, Any], env: dict[str, str],
           host: Host | None, cpu: int | None) -> Side:
    argv = [sys.executable, "-m", "bench.kv_transfer_peer"]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    if host is not None:
        argv = host.wrap(argv)
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=full_env)
    assert proc.stdin is not None and proc.stdout is not None
    ch = Channel(proc.stdout, proc.stdin)
    ch.send({**spec, "backend": backend, "role": role})
    return Side(proc, ch)


def run_pair(backend: str, spec: dict[str, Any], env: dict[str, str],
             hosts: tuple[Host, Host] | None, pin: bool) -> dict[str, Any]:
    """Start a server and a client side, relay the server's coordinates, return the result."""
    server = client = None
    try:
        server = _start(backend, "server", spec, env, hosts[0] if hosts else None,
                        0 if pin else None)
        coords = server.ch.recv()
        client = _start(backend, "client", spec, env, hosts[1] if hosts else None,
                        1 if pin else None)
        client.ch.send(coords)
        placement = placement_of({"server": server.proc.pid, "client": client.proc.pid})
        result: dict[str, Any] = client.ch.recv()
        server.ch.send("done")
        result["placement"] = placement
        result["loadavg"] = os.getloadavg()
        client.proc.wait(60)
        server.proc.wait(60)
        return result
    finally:
        for running in (client, server):
            if running is not None:
                running.stop()


def memcpy_times(nbytes: int, repeats: int) -> list[float]:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return times


def gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _spread(nbytes: int, times: list[float]) -> str:
    rates = sorted(nbytes / t / 1e9 for t in times)
    return f"min {rates[0]:.2f} max {rates[-1]:.2f}"


def _percentiles_us(times: list[float]) -> dict[str, float]:
    dist = distribution([t * 1e6 for t in times])
    return {f"p{p}_us": round(float(dist[f"p{p}"] or 0), 1) for p in (50, 99)}


def _kv(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"expected K=V, got {pair!r}")
        out[key] = value
    return out


def _opts(pairs: list[str]) -> dict[str, Any]:
    """`K=V` engine options with ints, floats and 0/1 flags parsed."""
    out: dict[str, Any] = {}
    for key, value in _kv(pairs).items():
        for parse in (int, float):
            try:
                out[key] = parse(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


@contextlib.contextmanager
def _hosts(namespaced: bool) -> Iterator[tuple[Host, Host] | None]:
    if not namespaced:
        yield None
        return
    with host_pair() as pair:
        yield pair


def _describe(result: dict[str, Any]) -> str:
    cores = ", ".join(f"{k} on {v}" for k, v in result["placement"].items())
    load = "/".join(f"{x:.2f}" for x in result["loadavg"])
    return f"load {load}; {cores}"


def run_wire(wire: str, args: argparse.Namespace, layout: Layout, runs: list[Any],
             small_runs: list[Any], mem: float) -> dict[str, Any]:
    """Ours and NIXL on one wire; the JSON record of that wire."""
    kwargs, ours_env, nixl_env, namespaced = WIRE_SETUP[wire]
    nbytes = layout.total_pulled
    spec = {"layers": layout.layers, "region_bytes": layout.region_bytes,
            "local_region_bytes": layout.local_region_bytes, "runs": runs,
            "small_runs": small_runs, "repeats": args.repeats,
            "small_repeats": args.small_repeats,
            "engine_kwargs": {**kwargs, **_opts(args.ours_opt)},
            "server_engine_kwargs": _opts(args.ours_opt),
            "native_build": str(args.ours_build) if args.ours_build else None}
    small_bytes = sum(n for *_, n in small_runs)
    rec: dict[str, Any] = {
        "wire": wire, "message_bytes": nbytes, "memcpy_gbps": round(mem, 3),
        "geometry": {"layers": layout.layers, "block_bytes": layout.block,
                     "blocks_per_half": layout.blocks_per_half,
                     "pulled_blocks_per_half": layout.pulled_per_half, "ops": len(runs)},
        "small_pull": {"blocks_per_half": args.small_blocks, "bytes": small_bytes,
                       "ops": len(small_runs), "repeats": args.small_repeats},
    }
    with _hosts(namespaced) as hosts:
        ours = run_pair("ours", spec, {**ours_env, **_kv(args.ours_env)}, hosts, args.pin)
        if not ours["ok"]:
            raise SystemExit(f"{wire}: ours pulled wrong bytes")
        if ours["path"] != EXPECTED_PATH[wire]:
            raise SystemExit(f"{wire}: ours used path {ours['path']} ({ours['path_reason']}), "
                             f"expected {EXPECTED_PATH[wire]}")
        rate = gbps(nbytes, ours["times"])
        logger.info("%-9s ours  %6.2f GB/s (%s; path %s, %d ops)  [%s]", wire, rate,
                    _spread(nbytes, ours["times"]), ours["path"], ours["ops"], _describe(ours))
        rec.update(ours_gbps=round(rate, 3), ours_path=ours["path"],
                   ours_path_reason=ours["path_reason"], ours_ucx=ours["ucx"],
                   ours_loadavg=ours["loadavg"], ours_placement=ours["placement"],
                   ratio_vs_memcpy=round(rate / mem, 3))
        rec["small_pull"]["ours"] = _percentiles_us(ours["small_times"])
        if wire in SEALED_WIRES and not args.no_sealed:
            host_ip = hosts[0].ip if hosts else "127.0.0.1"
            sealed = run_pair("sealed", {**spec, "bind_host": host_ip, "advertise_host": host_ip},
                              {}, hosts, args.pin)
            if not sealed["ok"]:
                raise SystemExit(f"{wire}: the sealed tcp transport pulled wrong bytes")
            srate = gbps(nbytes, sealed["times"])
            logger.info("%-9s sealed %5.2f GB/s (%s; path %s, %d ops)  [%s]", wire, srate,
                        _spread(nbytes, sealed["times"]), sealed["path"], sealed["ops"],
                        _describe(sealed))
            rec.update(sealed_gbps=round(srate, 3), sealed_loadavg=sealed["loadavg"],
                       sealed_placement=sealed["placement"])
            rec["small_pull"]["sealed"] = _percentiles_us(sealed["small_times"])
        if not args.no_nixl and importlib.util.find_spec("nixl") is not None:
            nixl = run_pair("nixl", spec, {**nixl_env, **_kv(args.nixl_env)}, hosts, args.pin)
            if not nixl["ok"]:
                raise SystemExit(f"{wire}: NIXL pulled wrong bytes")
            nrate = gbps(nbytes, nixl["times"])
            logger.info("%-9s NIXL  %6.2f GB/s (%s)  [%s]", wire, nrate,
                        _spread(nbytes, nixl["times"]), _describe(nixl))
            rec.update(nixl_gbps=round(nrate, 3), ratio_vs_nixl=round(rate / nrate, 3),
                       nixl_loadavg=nixl["loadavg"], nixl_placement=nixl["placement"])
            if "sealed_gbps" in rec:
                rec["sealed_ratio_vs_nixl"] = round(rec["sealed_gbps"] / nrate, 3)
            rec["small_pull"]["nixl"] = _percentiles_us(nixl["small_times"])
        else:
            logger.warning("NIXL not measured (pip install --no-deps nixl nixl-cu12)")
            rec.update(nixl_gbps=None, ratio_vs_nixl=None)
    sp = rec["small_pull"]
    logger.info("%-9s small pull (%d ops, %d KiB): ours p50 %.0f us p99 %.0f us%s%s", wire,
                sp["ops"], small_bytes >> 10, sp["ours"]["p50_us"], sp["ours"]["p99_us"],
                f" | sealed p50 {sp['sealed']['p50_us']:.0f} us p99 "
                f"{sp['sealed']['p99_us']:.0f} us" if "sealed" in sp else "",
                f" | NIXL p50 {sp['nixl']['p50_us']:.0f} us p99 {sp['nixl']['p99_us']:.0f} us"
                if "nixl" in sp else "")
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wire", default=",".join(WIRES),
                        help=f"comma-separated, from {list(WIRES)}")
    parser.add_argument("--mib", type=int, default=256, help="MiB pulled per transfer")
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--small-blocks", type=int, default=16)
    parser.add_argument("--small-repeats", type=int, default=200)
    parser.add_argument("--ours-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--nixl-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--ours-opt", action="append", default=[], metavar="K=V",
                        help="UcxEngine keyword argument (e.g. wakeup=0, spin_us=1000)")
    parser.add_argument("--ours-build", type=Path,
                        help="directory of a _ucxrma build to use (python -m kernels.native.build "
                             "--ucx nixl --out DIR); default: the package's")
    parser.add_argument("--no-nixl", action="store_true")
    parser.add_argument("--no-sealed", action="store_true",
                        help="skip the sealed tcp transport (measured on default and tcp)")
    parser.add_argument("--pin", action="store_true", help="server on core 0, client on core 1")
    parser.add_argument("--json", type=Path, help="write the per-wire records here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wires = args.wire.split(",")
    for wire in wires:
        if wire not in WIRES:
            raise SystemExit(f"unknown wire {wire!r}; choose from {list(WIRES)}")

    layout = make_layout(args.mib, args.block_kib, args.layers)
    runs = build_runs(layout, block_ids(layout))
    small_runs = build_runs(layout, small_block_ids(layout, args.small_blocks))
    nbytes = layout.total_pulled
    logger.info("pulling %.1f MiB: %d layers x K/V, %d of %d blocks of %d KiB per half, "
                "%d coalesced ops, median of %d repeats", nbytes / 2**20, layout.layers,
                layout.pulled_per_half, layout.blocks_per_half, args.block_kib, len(runs),
                args.repeats)
    times = memcpy_times(nbytes, args.repeats)
    mem = gbps(nbytes, times)
    logger.info("memcpy (numpy, 1 thread, contiguous) %6.2f GB/s (%s)  [load %s]", mem,
                _spread(nbytes, times), "/".join(f"{x:.2f}" for x in os.getloadavg()))
    out = {wire: run_wire(wire, args, layout, runs, small_runs, mem) for wire in wires}
    logger.info("--")
    for wire, rec in out.items():
        logger.info("%-9s ours %.2f GB/s | sealed %s | NIXL %s | memcpy %.2f GB/s | ours/NIXL %s"
                    " | sealed/NIXL %s | ours/memcpy %.2f", wire, rec["ours_gbps"],
                    f"{rec['sealed_gbps']:.2f} GB/s" if "sealed_gbps" in rec else "-",
                    f"{rec['nixl_gbps']:.2f} GB/s" if rec["nixl_gbps"] else "-",
                    rec["memcpy_gbps"], rec["ratio_vs_nixl"] or "-",
                    rec.get("sealed_ratio_vs_nixl") or "-", rec["ratio_vs_memcpy"])
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
