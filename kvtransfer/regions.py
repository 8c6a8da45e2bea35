"""Paged KV tensors as registered regions: how the connector splits and registers them.

Kept free of vLLM so that the same code registers KV memory in the connector (inside a vLLM
worker) and in the GPU check (`bench/gpu_check.sh`, on a machine with torch and no vLLM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer.errors import KVTransferError
from kvtransfer.protocol import RegionSpec

if TYPE_CHECKING:
    import torch

    from kvtransfer.transport.base import Transport


def describe_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[
        tuple[str, torch.Tensor, int, RegionSpec]]:
    """Split every KV tensor into block-major regions: (name, tensor, block_dim, spec).

    The block dimension is the first of size ``num_blocks``. Dimensions before it (e.g. K/V on
    GPU layouts) become separate regions; everything after it must be one dense block.
    """
    out = []
    for name in sorted(kv_caches):
        t = kv_caches[name]
        if not t.is_contiguous():
            raise KVTransferError(f"KV cache {name} is not contiguous: {tuple(t.shape)}")
        dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
        if not dims:
            raise KVTransferError(f"KV cache {name} {tuple(t.shape)} has no {num_blocks}-block dim")
        d = dims[0]
        es = t.element_size()
        block_bytes = math.prod(t.shape[d + 1:]) * es
        outer = math.prod(t.shape[:d])
        outer_stride = (t.stride(d - 1) * es) if d > 0 else 0
        for o in range(outer):
            spec = RegionSpec(name=f"{name}#{o}", base=t.data_ptr() + o * outer_stride,
                              block_stride=t.stride(d) * es, block_bytes=block_bytes,
                              num_blocks=num_blocks, rkey=b"")
            out.append((name, t, d, spec))
    return out


@dataclass(frozen=True)
class RegisteredKV:
    """The KV tensors of one engine as registered with its transport."""

    regions: tuple[RegionSpec, ...]
    """One per (tensor, leading index), in `describe_regions` order, each with its rkey."""
    tensors: tuple[tuple[torch.Tensor, int], ...]
    """(tensor, block dimension) per region, the tensor kept alive by the registration."""
    memory_types: tuple[str, ...]
    """What the transport found each region's memory to be ("host", "cuda", ...)."""


def register_kv_caches(engine: Transport, kv_caches: dict[str, torch.Tensor],
                       num_blocks: int) -> RegisteredKV:
    """Register every region of `kv_caches` with `engine` (the tensor as keepalive, so a CUDA
    tensor registers as device memory) and return their specs with rkeys."""
    regions, tensors, types = [], [], []
    for _, tensor, block_dim, spec in describe_regions(kv_caches, num_blocks):
        reg = engine.register(spec.base, spec.num_blocks * spec.block_stride, keepalive=tensor)
        regions.append(RegionSpec(spec.name, spec.base, spec.block_stride, spec.block_bytes,
                                  spec.num_blocks, reg.rkey))
        tensors.append((tensor, block_dim))
        types.append(str(getattr(reg, "memory_type", "host")))
    return RegisteredKV(tuple(regions), tuple(tensors), tuple(types))
