"""One side of the GPU check's KV pull, run as its own process: `python -m bench.gpu_pull`.

The driver (`bench.gpu_check`) writes one spec to stdin and the side answers on stdout (one
base64 pickle per line, `bench.kv_transfer_peer.Channel`; library output goes to stderr).

prefill  builds vLLM-shaped paged KV tensors on `device` (per layer `[2, num_blocks,
         *BLOCK_SHAPE]` bf16: K and V first, as vLLM's FlashAttention backend lays them out),
         fills them with a seeded pattern, registers them through the connector's own code
         (`open_transport` with the connector's configuration, then
         `kvtransfer.regions.register_kv_caches`), sends its handshake, waits for "done", then
         checks that every byte of its KV is still the pattern.
decode   builds the same tensors, registers them the same way, connects, and for every
         (layout, size) pulls blocks with the connector's op builder (`coalesce_runs`,
         `build_read_ops`, `Peer.get`): one warm-up pull after which every destination byte is
         checked (the pulled blocks equal the prefill's pattern, every other block is still
         the sentinel), timed pulls, then torch copying the same number of bytes between the
         same two tensors in one process (the limit). Last, the small pull's latency.

Only torch, numpy and this repository are imported: the GPU machine has no vLLM.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from bench.kv_transfer_peer import Channel

BLOCK_SHAPE = (16, 8, 128)
"""Tokens per block, KV heads, head size: vLLM's default GPU block of a Llama-3-8B-like layer
(32 KiB per block of K or V in bf16)."""
DTYPE = torch.bfloat16
SENTINEL = 0x5A5A
"""What every destination block holds before a pull (as int16)."""
SMALL_BLOCKS = 16
"""The small pull: 16 blocks per region, a 256-token prompt's KV."""


def block_bytes() -> int:
    """Bytes of one block of K (or V) of one layer."""
    return int(np.prod(BLOCK_SHAPE)) * torch.tensor([], dtype=DTYPE).element_size()


def make_kv(layers: int, num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    """Uninitialised per-layer KV tensors named as vLLM names its attention layers."""
    return {f"model.layers.{i}.self_attn.attn": torch.empty((2, num_blocks, *BLOCK_SHAPE),
                                                            dtype=DTYPE, device=device)
            for i in range(layers)}


def fill_pattern(kv: dict[str, torch.Tensor], seed: int) -> None:
    """Seeded bytes per layer; the same seed gives the same bytes in any process."""
    for i, name in enumerate(sorted(kv)):
        t = kv[name]
        gen = torch.Generator(device=t.device).manual_seed(seed + i)
        t.view(torch.int16).random_(-32768, 32767, generator=gen)


def fill_sentinel(kv: dict[str, torch.Tensor]) -> None:
    """Every byte of `kv` to the sentinel."""
    for t in kv.values():
        t.view(torch.int16).fill_(SENTINEL)


def sync(device: str) -> None:
    """Wait for the device's queued work (a fill must land before a pull reads or writes)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """True when every byte of `a` equals `b`'s (same names, shapes)."""
    return all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def pulled_correctly(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor],
                     local: Sequence[int], remote: Sequence[int]) -> bool:
    """Every destination byte checked: block `local[i]` of every region equals the source's
    `remote[i]`, and every block not pulled into still holds the sentinel."""
    any_t = next(iter(dst.values()))
    li = torch.as_tensor(np.asarray(local, dtype=np.int64), device=any_t.device)
    ri = torch.as_tensor(np.asarray(remote, dtype=np.int64), device=any_t.device)
    untouched = torch.ones(any_t.shape[1], dtype=torch.bool, device=any_t.device)
    untouched[li] = False
    for name in dst:
        d16, s16 = dst[name].view(torch.int16), src[name].view(torch.int16)
        if not torch.equal(d16.index_select(1, li), s16.index_select(1, ri)):
            return False
        if not bool((d16[:, untouched] == SENTINEL).all()):
            return False
    return True


def block_sets(layout: str, n: int, num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """(local, remote) block ids of one pull: "contiguous" is one run per region (a fresh
    engine's long prompt), "scattered" two sorted random samples (a fragmented cache)."""
    if layout == "contiguous":
        return list(range(num_blocks - n, num_blocks)), list(range(n))
    rng = np.random.default_rng(seed)
    local = np.sort(rng.choice(num_blocks, n, replace=False))
    remote = np.sort(rng.choice(num_blocks, n, replace=False))
    return [int(x) for x in local], [int(x) for x in remote]


def timed(once: Callable[[], object], repeats: int, device: str) -> list[float]:
    """Seconds of each of `repeats` calls, the device idle before and after each."""
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        once()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _transport(label: str) -> Any:
    """The connector's transport, configured as the connector configures it (PDSERVE_* knobs
    from the environment)."""
    from kvtransfer.config import ConnectorConfig
    from kvtransfer.transport.factory import open_transport

    return open_transport(ConnectorConfig.from_extra_config({"transport": "ucx"}), label=label)


def _prefill(ch: Channel, spec: dict[str, Any]) -> None:
    from kvtransfer.regions import register_kv_caches

    kv = make_kv(spec["layers"], spec["num_blocks"], spec["device"])
    fill_pattern(kv, spec["seed"])
    sync(spec["device"])
    engine = _transport("gpu-check-prefill")
    reg = register_kv_caches(engine, kv, spec["num_blocks"])
    ch.send({"address": engine.address, "locality": engine.locality, "regions": reg.regions,
             "memory_types": reg.memory_types})
    ch.recv()  # the decode is done
    expected = make_kv(spec["layers"], spec["num_blocks"], spec["device"])
    fill_pattern(expected, spec["seed"])
    ch.send({"source_intact": same_bytes(kv, expected)})
    engine.close()


def _decode(ch: Channel, spec: dict[str, Any]) -> None:
    from kernels import native
    from kvtransfer.blocks import build_read_ops, coalesce_runs
    from kvtransfer.regions import register_kv_caches

    hs = ch.recv()
    device, num_blocks = spec["device"], spec["num_blocks"]
    dst = make_kv(spec["layers"], num_blocks, device)
    src = make_kv(spec["layers"], num_blocks, device)  # the prefill's bytes, to check against
    fill_pattern(src, spec["seed"])
    fill_sentinel(dst)
    sync(device)
    engine = _transport("gpu-check-decode")
    reg = register_kv_caches(engine, dst, num_blocks)
    peer = engine.connect(hs["address"], hs["locality"] or None)
    rkeys = [peer.unpack_rkey(r.rkey, base=r.base, length=r.num_blocks * r.block_stride)
             for r in hs["regions"]]

    def pull(ops: np.ndarray) -> None:
        transfer = peer.get(ops)
        transfer.wait(spec["pull_timeout_s"])
        if transfer.poll() != "done":
            raise RuntimeError(f"pull failed: {transfer.error or 'timed out'}")

    def torch_copy(n: int) -> None:
        # The same number of bytes per region, copied by torch between the same two tensors,
        # one contiguous run per region (K and V apart), so the device's copy engine runs at
        # its best (a strided view would go through a slower elementwise kernel).
        for name in dst:
            for kv in range(dst[name].shape[0]):
                dst[name][kv, :n].copy_(src[name][kv, num_blocks - n:])

    rows: list[dict[str, Any]] = []
    per_block = len(reg.regions) * block_bytes()
    for mib in spec["sizes_mib"]:
        n = mib * 2**20 // per_block
        if any(r["pull_s"] and max(r["pull_s"]) > spec["slow_pull_s"] for r in rows):
            print(f"{mib} MiB and up skipped: a smaller pull took over {spec['slow_pull_s']} s",
                  file=sys.stderr, flush=True)
            break
        for layout in spec["layouts"]:
            local, remote = block_sets(layout, n, num_blocks, spec["seed"] + n)
            ops = build_read_ops(coalesce_runs(local, remote), reg.regions, hs["regions"], rkeys)
            fill_sentinel(dst)
            sync(device)
            pull(ops)
            ok = pulled_correctly(dst, src, local, remote)
            pull_s = timed(partial(pull, ops), spec["repeats"], device)
            ok = ok and pulled_correctly(dst, src, local, remote)
            torch_s = timed(partial(torch_copy, n), spec["repeats"], device)
            rows.append({"layout": layout, "mib": mib, "bytes": n * per_block, "ops": len(ops),
                         "ok": ok, "pull_s": pull_s, "torch_s": torch_s})
            print(f"{layout} {mib} MiB: ok={ok} pull {min(pull_s) * 1e3:.2f} ms "
                  f"torch {min(torch_s) * 1e3:.2f} ms", file=sys.stderr, flush=True)
    local, remote = block_sets("scattered", SMALL_BLOCKS, num_blocks, spec["seed"])
    ops = build_read_ops(coalesce_runs(local, remote), reg.regions, hs["regions"], rkeys)
    fill_sentinel(dst)
    sync(device)
    pull(ops)
    small_ok = pulled_correctly(dst, src, local, remote)
    small = {"blocks": SMALL_BLOCKS, "bytes": SMALL_BLOCKS * per_block, "ops": len(ops),
             "ok": small_ok,
             "pull_s": timed(partial(pull, ops), spec["small_repeats"], device),
             "torch_s": timed(partial(torch_copy, SMALL_BLOCKS), spec["small_repeats"], device)}
    ch.send({"rows": rows, "small": small, "path": peer.path, "path_reason": peer.path_reason,
             "memory_types": reg.memory_types, "engine_memory_types": engine.memory_types,
             "ucx": native.runtime_info()})
    engine.close()


ROLES = {"prefill": _prefill, "decode": _decode}


def main() -> int:
    """Run the role named by the spec on stdin."""
    ctl = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed by libraries (UCX's protocol tables) goes to stderr
    ch = Channel(sys.stdin, ctl)
    spec = ch.recv()
    if spec.get("native_build"):
        from kernels import native

        native.select(spec["native_build"])
    try:
        ROLES[spec["role"]](ch, spec)
    except Exception as exc:
        ch.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
