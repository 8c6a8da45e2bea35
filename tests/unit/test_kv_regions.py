"""How paged KV tensors are split into block-major regions for registration."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.errors import KVTransferError
from kvtransfer.regions import describe_regions


def test_block_major_layout_is_one_dense_region_per_layer() -> None:
    caches = {f"layer.{i}": torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for i in range(2)}
    regions = describe_regions(caches, num_blocks=8)
    assert [spec.name for *_, spec in regions] == ["layer.0#0", "layer.1#0"]
    spec = regions[0][3]
    assert spec.base == caches["layer.0"].data_ptr()
    assert spec.block_bytes == spec.block_stride == 2 * 4 * 16 * 2
    assert spec.block_addr(3) == spec.base + 3 * spec.block_bytes


def test_kv_first_layout_gives_one_region_per_k_and_v() -> None:
    t = torch.zeros(2, 8, 4, 16, dtype=torch.float16)  # [K/V, blocks, ...] as on GPU backends
    regions = describe_regions({"l": t}, num_blocks=8)
    k, v = (spec for *_, spec in regions)
    assert v.base - k.base == 8 * 4 * 16 * 2
    assert k.block_bytes == 4 * 16 * 2


def test_non_contiguous_or_blockless_tensors_are_rejected() -> None:
    with pytest.raises(KVTransferError):
        describe_regions({"l": torch.zeros(8, 4).t()}, num_blocks=8)
    with pytest.raises(KVTransferError):
        describe_regions({"l": torch.zeros(3, 4)}, num_blocks=8)


def test_registration_gives_every_region_an_rkey_and_its_memory_type() -> None:
    from kvtransfer.regions import register_kv_caches
    from kvtransfer.transport import UcxEngine

    caches = {f"layer.{i}": torch.zeros(2, 8, 4, 16, dtype=torch.bfloat16) for i in range(2)}
    with UcxEngine(name="regions-test") as engine:
        registered = register_kv_caches(engine, caches, num_blocks=8)
    described = [spec for *_, spec in describe_regions(caches, num_blocks=8)]
    assert [(r.name, r.base, r.block_bytes) for r in registered.regions] == [
        (s.name, s.base, s.block_bytes) for s in described]
    assert all(r.rkey for r in registered.regions)
    assert registered.memory_types == ("host",) * 4  # CPU tensors: host memory, on CPU UCX
    assert [t for t, _ in registered.tensors] == [caches["layer.0"]] * 2 + [caches["layer.1"]] * 2
