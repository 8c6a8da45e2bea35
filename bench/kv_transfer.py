"""KV-shaped pull benchmark: our transport (same-host pvm path and UCX path) vs NIXL READ vs a
single-thread memcpy.

    python bench/kv_transfer.py --mib 256

Layout: `--layers` registered regions per side (one per layer, like vLLM's per-layer KV tensors),
each split into K and V halves of `num_blocks` blocks of `--block-kib`. The decode side pulls
`--mib` MiB: a random permutation of prefill block ids built from contiguous runs (1..8 blocks),
for every layer and K/V half, into consecutive local blocks. Runs contiguous on both sides are
coalesced into one op, as the connector does. Every backend pulls exactly the same (local,
remote, length) list between two spawned processes; the memcpy baseline copies the same number
of bytes in one process with one contiguous numpy copy. Medians over `--repeats` (after one
warm-up pull whose bytes are checked).

ours(pvm) is our transport with the server's locality passed to `connect` (same-host
process_vm_readv path; "pvm" with 1 worker thread, "pvm2" with 2); ours(ucx) is the same transport
forced onto UCX (`PDSERVE_KV_SAME_HOST=0`) under each UCX config, the best one reported.

Parameters (defaults): --mib 256, --block-kib 32, --layers 16, --repeats 7,
--configs "pvm,pvm2,ucx-default,ucx-nowakeup,ucx-tcp", --nixl-config default, --no-nixl.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    # Run as a script, sys.path[0] is bench/, whose trace.py and profile.py would shadow the
    # standard library's modules of those names: put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

logger = logging.getLogger("bench.kv_transfer")

UCX_CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    "cma": {"UCX_TLS": "cma,tcp"},
    "sm": {"UCX_TLS": "sm,tcp"},
    "tcp": {"UCX_TLS": "tcp"},
    "tcp-bigseg": {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"},
    "nowakeup": {"PDSERVE_UCX_WAKEUP": "0"},
    "spin5ms": {"PDSERVE_UCX_SPIN_US": "5000"},
}

# Our transport's configs: (expected get path, environment of both processes).
OURS_CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "pvm": ("pvm", {"PDSERVE_KV_PVM_THREADS": "1"}),
    "pvm2": ("pvm", {"PDSERVE_KV_PVM_THREADS": "2"}),
    **{f"ucx-{name}": ("ucx", {**env, "PDSERVE_KV_SAME_HOST": "0"})
       for name, env in UCX_CONFIGS.items()},
}


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


def _fill(buf: np.ndarray, layer: int) -> None:
    buf[:] = np.random.default_rng(1000 + layer).integers(0, 256, buf.size, dtype=np.uint8)


def _expected_checksum(layout: Layout, runs: list[tuple[int, int, int, int]]) -> int:
    total = 0
    srcs = {}
    for layer, _lo, ro, n in runs:
        if layer not in srcs:
            srcs[layer] = np.empty(layout.region_bytes, np.uint8)
            _fill(srcs[layer], layer)
        total += int(srcs[layer][ro:ro + n].astype(np.uint64).sum()) * (layer + 1)
    return total


def _checksum(dsts: list[np.ndarray], runs: list[tuple[int, int, int, int]]) -> int:
    return sum(int(dsts[layer][lo:lo + n].astype(np.uint64).sum()) * (layer + 1)
               for layer, lo, _ro, n in runs)


# --------------------------------------------------------------------------- ours


def _ours_server(conn: Any, layout: Layout, env: dict[str, str]) -> None:
    os.environ.update(env)
    from kvtransfer.transport import UcxEngine

    engine = UcxEngine(name="bench-prefill")
    bufs = []
    meta = []
    for layer in range(layout.layers):
        buf = np.empty(layout.region_bytes, np.uint8)
        _fill(buf, layer)
        reg = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
        bufs.append(buf)
        meta.append((reg.addr, reg.rkey))
    conn.send((engine.address, engine.locality, meta))
    conn.recv()  # client done
    engine.close()


def _ours_client(conn: Any, layout: Layout, runs: list[tuple[int, int, int, int]],
                 env: dict[str, str], repeats: int, result: Any) -> None:
    os.environ.update(env)
    from kvtransfer.transport import UcxEngine

    address, locality, meta = conn.recv()
    engine = UcxEngine(name="bench-decode")
    dsts = [np.ones(layout.local_region_bytes, np.uint8) for _ in range(layout.layers)]
    for d in dsts:
        engine.register(d.ctypes.data, d.nbytes, keepalive=d)
    peer = engine.connect(address, locality)
    rkeys = [peer.unpack_rkey(rk, base=addr, length=layout.region_bytes) for addr, rk in meta]
    ops = np.array([(dsts[layer].ctypes.data + lo, meta[layer][0] + ro, n, rkeys[layer])
                    for layer, lo, ro, n in runs], dtype=np.uint64)
    warm = peer.get(ops)  # warm-up: connection, registration caches
    warm.wait(60)
    ok = _checksum(dsts, runs) == _expected_checksum(layout, runs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        peer.get(ops).wait(60)
        times.append(time.perf_counter() - t0)
    result.put((ok, times, len(ops), warm.path))
    conn.send("done")
    engine.close()


# --------------------------------------------------------------------------- NIXL


def _nixl_server(conn: Any, layout: Layout, env: dict[str, str]) -> None:
    os.environ.update(env)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    bufs = []
    for layer in range(layout.layers):
        buf = np.empty(layout.region_bytes, np.uint8)
        _fill(buf, layer)
        bufs.append(buf)
    reg = agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
    conn.send((agent.get_agent_metadata(), [b.ctypes.data for b in bufs]))
    conn.recv()
    agent.deregister_memory(reg)


def _nixl_client(conn: Any, layout: Layout, runs: list[tuple[int, int, int, int]],
                 env: dict[str, str], repeats: int, result: Any) -> None:
    os.environ.update(env)
    from nixl._api import nixl_agent, nixl_agent_config

    md, raddrs = conn.recv()
    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    peer = agent.add_remote_agent(md)
    dsts = [np.ones(layout.local_region_bytes, np.uint8) for _ in range(layout.layers)]
    reg = agent.register_memory([(d.ctypes.data, d.nbytes, 0, "") for d in dsts], "DRAM")
    local = agent.get_xfer_descs([(dsts[layer].ctypes.data + lo, n, 0)
                                  for layer, lo, _ro, n in runs], "DRAM")
    remote = agent.get_xfer_descs([(raddrs[layer] + ro, n, 0) for layer, _lo, ro, n in runs],
                                  "DRAM")
    handle = agent.initialize_xfer("READ", local, remote, peer)

    def once() -> None:
        state = agent.transfer(handle)
        deadline = time.monotonic() + 60
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise RuntimeError("NIXL transfer timed out")
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")

    once()
    ok = _checksum(dsts, runs) == _expected_checksum(layout, runs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    result.put((ok, times, len(runs), "nixl"))
    agent.release_xfer_handle(handle)
    agent.deregister_memory(reg)
    agent.remove_remote_agent(peer)
    conn.send("done")


# --------------------------------------------------------------------------- driver


def run_pair(server: Any, client: Any, layout: Layout, runs: list[tuple[int, int, int, int]],
             env: dict[str, str], repeats: int) -> tuple[bool, list[float], int, str]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    result = ctx.Queue()
    ps = ctx.Process(target=server, args=(a, layout, env), daemon=True)
    pc = ctx.Process(target=client, args=(b, layout, runs, env, repeats, result), daemon=True)
    ps.start()
    pc.start()
    try:
        out: tuple[bool, list[float], int, str] = result.get(timeout=300)
    finally:
        for p in (pc, ps):
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB pulled per transfer")
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--configs", default="pvm,pvm2,ucx-default,ucx-nowakeup,ucx-tcp",
                        help=f"configs for ours, from {sorted(OURS_CONFIGS)}")
    parser.add_argument("--nixl-config", default="default", help="UCX config for NIXL")
    parser.add_argument("--no-nixl", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    layout = make_layout(args.mib, args.block_kib, args.layers)
    runs = build_runs(layout, block_ids(layout))
    nbytes = layout.total_pulled
    logger.info("pulling %.1f MiB: %d layers x K/V, %d of %d blocks of %d KiB per half, "
                "%d coalesced ops, median of %d repeats", nbytes / 2**20, layout.layers,
                layout.pulled_per_half, layout.blocks_per_half, args.block_kib, len(runs),
                args.repeats)

    times = memcpy_times(nbytes, args.repeats)
    mem = gbps(nbytes, times)
    logger.info("memcpy (numpy, 1 thread, contiguous)      %6.2f GB/s  (%s)", mem,
                _spread(nbytes, times))

    best: dict[str, tuple[float, str]] = {}
    for name in args.configs.split(","):
        want, env = OURS_CONFIGS[name]
        ok, times, nops, path = run_pair(_ours_server, _ours_client, layout, runs, env,
                                         args.repeats)
        rate = gbps(nbytes, times)
        logger.info("ours  [%-13s path %-3s] %6.2f GB/s  (%s; %d ops, bytes %s)", name, path,
                    rate, _spread(nbytes, times), nops, "ok" if ok else "WRONG")
        if not ok:
            logger.error("ours pulled wrong bytes with config %s", name)
            return 1
        if path != want:
            logger.error("config %s used path %s, expected %s", name, path, want)
            return 1
        if path not in best or rate > best[path][0]:
            best[path] = (rate, name)

    nixl: float | None = None
    if not args.no_nixl:
        try:
            importlib.import_module("nixl._api")
        except ImportError:
            logger.warning("NIXL is not installed (.venv/bin/pip install --no-deps nixl "
                           "nixl-cu12): skipping the NIXL READ comparison")
        else:
            env = UCX_CONFIGS[args.nixl_config]
            ok, times, _, _ = run_pair(_nixl_server, _nixl_client, layout, runs, env,
                                       args.repeats)
            nixl = gbps(nbytes, times)
            logger.info("NIXL READ [%-19s] %6.2f GB/s  (%s; bytes %s)", args.nixl_config, nixl,
                        _spread(nbytes, times), "ok" if ok else "WRONG")
            if not ok:
                logger.error("NIXL pulled wrong bytes")
                return 1

    logger.info("--")
    logger.info("memcpy %.2f GB/s | NIXL READ %s", mem,
                f"{nixl:.2f} GB/s" if nixl is not None else "not measured")
    for path in ("pvm", "ucx"):
        if path not in best:
            continue
        rate, name = best[path]
        line = f"ours({path}) {rate:.2f} GB/s [{name}] | ours/memcpy {rate / mem:.2f}"
        if nixl is not None:
            line += f" | ours/NIXL {rate / nixl:.2f}"
        logger.info("%s", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
