"""The connector's CUDA-specific paths on a real GPU (skipped where torch sees no CUDA device).

`bash bench/gpu_check.sh` runs this file on a GPU machine, without the suite's conftest (that
machine has no vLLM), with the extension it built named by PDSERVE_NATIVE_BUILD. Each test has
a host-memory control beside the CUDA case, so a UCX that treats everything as host memory
fails here rather than passing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gpu_check import run_variant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def ucx() -> Iterator[type]:
    """`UcxEngine`, loaded from PDSERVE_NATIVE_BUILD when set (the GPU check's own build)."""
    from kernels import native

    if os.environ.get("PDSERVE_NATIVE_BUILD"):
        native.select(os.environ["PDSERVE_NATIVE_BUILD"])
    from kvtransfer.transport import UcxEngine

    yield UcxEngine


def _vllm_layouts(num_blocks: int) -> dict[str, dict[str, torch.Tensor]]:
    """KV caches shaped as vLLM's GPU attention backends allocate them, one layer each."""
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    return {
        "flash_attn": {"l0": torch.zeros(2, num_blocks, 16, 8, 128, **kw)},  # K/V first
        "flashinfer": {"l0": torch.zeros(num_blocks, 2, 16, 8, 128, **kw)},  # blocks first
        "mla": {"l0": torch.zeros(num_blocks, 16, 576, **kw)},  # one latent per token
    }


def test_cuda_tensor_is_detected_and_registered_as_device_memory(ucx: type) -> None:
    from kvtransfer.transport.ucx import _memory_type

    with ucx(name="gpu-reg") as engine:
        assert "cuda" in engine.memory_types, engine.context_info()
        dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        host = torch.zeros(1 << 20, dtype=torch.uint8)
        assert _memory_type(dev) == "cuda" and _memory_type(host) is None
        assert engine.register(dev.data_ptr(), dev.numel(), keepalive=dev).memory_type == "cuda"
        assert engine.register(host.data_ptr(), host.numel(), keepalive=host).memory_type == "host"


def test_device_memory_turns_the_same_host_path_off(ucx: type) -> None:
    with ucx(name="gpu-src") as src, ucx(name="gpu-dst") as dst:
        host = torch.zeros(1 << 16, dtype=torch.uint8)
        dst.register(host.data_ptr(), host.numel(), keepalive=host)
        assert dst.locality != b""  # host memory only: the same-host path is advertised
        assert dst.connect(src.address, src.locality).path == "pvm"
        dev = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
        dst.register(dev.data_ptr(), dev.numel(), keepalive=dev)
        assert dst.locality == b""
        peer = dst.connect(src.address, src.locality)
        assert peer.path == "ucx"
        assert peer.path_reason == "local KV memory is not host memory"


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
def test_vllm_shaped_kv_registers_and_pulls_every_byte(ucx: type, layout: str) -> None:
    from kvtransfer.blocks import build_read_ops, coalesce_runs
    from kvtransfer.regions import register_kv_caches

    num_blocks = 64
    src_kv, dst_kv = _vllm_layouts(num_blocks)[layout], _vllm_layouts(num_blocks)[layout]
    gen = torch.Generator(device="cuda").manual_seed(7)
    src_kv["l0"].view(torch.int16).random_(-32768, 32767, generator=gen)
    dst_kv["l0"].view(torch.int16).fill_(0x5A5A)
    torch.cuda.synchronize()
    with ucx(name="gpu-prefill") as pre, ucx(name="gpu-decode") as dec:
        src = register_kv_caches(pre, src_kv, num_blocks)
        dst = register_kv_caches(dec, dst_kv, num_blocks)
        assert set(src.memory_types) == set(dst.memory_types) == {"cuda"}
        assert len(src.regions) == (2 if layout == "flash_attn" else 1)
        peer = dec.connect(pre.address, pre.locality or None)
        rkeys = [peer.unpack_rkey(r.rkey, base=r.base, length=r.num_blocks * r.block_stride)
                 for r in src.regions]
        local, remote = [3, 4, 5, 9, 40], [10, 11, 12, 2, 63]
        ops = build_read_ops(coalesce_runs(local, remote), dst.regions, src.regions, rkeys)
        transfer = peer.get(ops)
        transfer.wait(60)
        assert transfer.poll() == "done", transfer.error
    d16, s16 = dst_kv["l0"].view(torch.int16), src_kv["l0"].view(torch.int16)
    bdim = 1 if layout == "flash_attn" else 0
    li, ri = torch.tensor(local, device="cuda"), torch.tensor(remote, device="cuda")
    assert torch.equal(d16.index_select(bdim, li), s16.index_select(bdim, ri))
    rest = torch.from_numpy(np.setdiff1d(np.arange(num_blocks), local)).cuda()
    assert bool((d16.index_select(bdim, rest) == 0x5A5A).all())  # nothing else was written


@pytest.mark.parametrize("user_setting", [None, "n"])
def test_gpu_kv_pulls_ride_cuda_ipc_unless_the_user_turns_its_gets_off(
        user_setting: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # UCX's own default turns cuda_ipc GETs off where NVML shows no NVLink (a single GPU, PCIe
    # boxes), and the pull then falls back to active-message emulation over tcp; the engine's
    # default keeps them on. Two processes (cuda_ipc never connects a process to itself).
    # Control: with the user's "n" the GETs are emulated, so the table really was read.
    from kvtransfer.transport.ucx import CUDA_IPC_GET_ENV

    if user_setting is None:
        monkeypatch.delenv(CUDA_IPC_GET_ENV, raising=False)
    else:
        monkeypatch.setenv(CUDA_IPC_GET_ENV, user_setting)
    spec = {"layers": 1, "sizes_mib": [1], "seed": 5, "num_blocks": 64,
            "layouts": ["contiguous"], "repeats": 1, "small_repeats": 2, "pull_timeout_s": 30.0,
            "slow_pull_s": 30.0, "native_build": os.environ.get("PDSERVE_NATIVE_BUILD") or None}
    result = run_variant("cuda-auto", spec, tmp_path, timeout_s=90)
    assert "error" not in result, result["error"]
    assert all(r["ok"] for r in result["rows"]) and result["small"]["ok"]
    rows = result["get_protocols"]
    assert rows, "UCX printed no protocol table for the GETs into CUDA memory"
    if user_setting is None:
        assert all("cuda_ipc" in row for row in rows), rows
    else:
        assert not any("cuda_ipc" in row for row in rows), rows
