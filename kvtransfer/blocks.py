"""Pure block arithmetic: coalesce block-id lists into runs and runs into RMA read ops."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtransfer.protocol import RegionSpec


def coalesce_runs(local_ids: Sequence[int],
                  remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group pairs (local[i], remote[i]) into runs contiguous on both sides.

    Returns ``(local_start, remote_start, count)`` triples in input order; one run becomes one
    transfer per region, as in KVDirect.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for loc, rem in zip(local_ids, remote_ids, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if loc == l0 + n and rem == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((loc, rem, 1))
    return runs


def build_read_ops(runs: Sequence[tuple[int, int, int]], local: Sequence[RegionSpec],
                   remote: Sequence[RegionSpec], rkey_indices: Sequence[int]) -> np.ndarray:
    """RMA ops ``(local_addr, remote_addr, nbytes, rkey_index)`` for every (region, run).

    A run is one op only where both sides store consecutive blocks back to back
    (``block_stride == block_bytes``); otherwise each block of the run is its own op.
    """
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local regions but {len(remote)} remote regions")
    ops: list[tuple[int, int, int, int]] = []
    for loc, rem, rkey in zip(local, remote, rkey_indices, strict=True):
        if loc.block_bytes != rem.block_bytes:
            raise ValueError(f"region {loc.name}: block size {loc.block_bytes} "
                             f"!= {rem.block_bytes}")
        dense = loc.block_stride == loc.block_bytes and rem.block_stride == rem.block_bytes
        for l0, r0, n in runs:
            if min(l0, r0) < 0 or l0 + n > loc.num_blocks or r0 + n > rem.num_blocks:
                raise ValueError(f"run ({l0}, {r0}, {n}) outside region {loc.name}")
            if dense:
                ops.append((loc.block_addr(l0), rem.block_addr(r0), n * loc.block_bytes, rkey))
            else:
                ops.extend((loc.block_addr(l0 + i), rem.block_addr(r0 + i), loc.block_bytes, rkey)
                           for i in range(n))
    return np.asarray(ops, dtype=np.uint64).reshape(-1, 4)
