"""Block-run coalescing and RMA op construction (pure)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransfer.blocks import build_read_ops, coalesce_runs
from kvtransfer.protocol import RegionSpec


@pytest.mark.parametrize(("local", "remote", "runs"), [
    ([], [], []),
    ([5], [9], [(5, 9, 1)]),
    ([1, 2, 3], [7, 8, 9], [(1, 7, 3)]),
    ([1, 2, 3], [7, 8, 10], [(1, 7, 2), (3, 10, 1)]),
    ([1, 3, 4], [7, 8, 9], [(1, 7, 1), (3, 8, 2)]),
    ([4, 3, 2], [1, 2, 3], [(4, 1, 1), (3, 2, 1), (2, 3, 1)]),
])
def test_coalesce_runs_table(local: list[int], remote: list[int],
                             runs: list[tuple[int, int, int]]) -> None:
    assert coalesce_runs(local, remote) == runs


def test_coalesce_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError):
        coalesce_runs([1, 2], [1])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_runs_expand_back_to_the_pairs(pairs: list[tuple[int, int]]) -> None:
    local, remote = [p[0] for p in pairs], [p[1] for p in pairs]
    expanded = [(l0 + i, r0 + i) for l0, r0, n in coalesce_runs(local, remote) for i in range(n)]
    assert expanded == pairs


def region(name: str, base: int, stride: int, size: int = 64, blocks: int = 100) -> RegionSpec:
    return RegionSpec(name, base, stride, size, blocks, b"")


def test_dense_regions_read_one_op_per_run() -> None:
    local = [region("a", 1000, 64), region("b", 50_000, 64)]
    remote = [region("a", 9000, 64), region("b", 90_000, 64)]
    ops = build_read_ops([(2, 5, 3), (10, 20, 1)], local, remote, [7, 8])
    assert ops.dtype == np.uint64
    assert ops.tolist() == [
        [1000 + 2 * 64, 9000 + 5 * 64, 192, 7],
        [1000 + 10 * 64, 9000 + 20 * 64, 64, 7],
        [50_000 + 2 * 64, 90_000 + 5 * 64, 192, 8],
        [50_000 + 10 * 64, 90_000 + 20 * 64, 64, 8],
    ]


def test_strided_regions_read_block_by_block() -> None:
    ops = build_read_ops([(0, 1, 2)], [region("a", 0, 128)], [region("a", 0, 64)], [0])
    assert ops.tolist() == [[0, 64, 64, 0], [128, 128, 64, 0]]


@pytest.mark.parametrize("run", [(99, 0, 2), (-3, 1, 1), (1, -3, 1)])
def test_out_of_range_run_is_rejected(run: tuple[int, int, int]) -> None:
    """A negative block id on either side (review finding 19: ``max`` let a negative local id
    through, an address below the region) is rejected like one past the end."""
    with pytest.raises(ValueError):
        build_read_ops([run], [region("a", 0, 64)], [region("a", 0, 64)], [0])


def test_block_size_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        build_read_ops([(0, 0, 1)], [region("a", 0, 64)], [region("a", 0, 32, size=32)], [0])
