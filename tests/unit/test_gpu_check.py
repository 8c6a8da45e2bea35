"""The GPU check's own logic on CPU (bench/gpu_check.sh, bench/gpu_pull.py): its byte check
catches a wrong or stray byte, its block sets are what they claim, and without a GPU the
whole script runs its host part and then fails clearly (exit 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import NO_GPU, get_protocols, get_transport_ok, passed, summarize
from bench.gpu_pull import block_sets, fill_pattern, fill_sentinel, make_kv, pulled_correctly
from kvtransfer.blocks import coalesce_runs

ROOT = Path(__file__).resolve().parents[2]


def _pulled(local: list[int], remote: list[int]) -> tuple[dict[str, torch.Tensor],
                                                          dict[str, torch.Tensor]]:
    src, dst = make_kv(2, 32, "cpu"), make_kv(2, 32, "cpu")
    fill_pattern(src, seed=5)
    fill_sentinel(dst)
    for name in dst:
        dst[name][:, local] = src[name][:, remote]
    return dst, src


def test_byte_check_passes_a_faithful_pull_and_catches_wrong_and_stray_bytes() -> None:
    local, remote = [1, 2, 7], [30, 4, 5]
    dst, src = _pulled(local, remote)
    assert pulled_correctly(dst, src, local, remote)
    assert not pulled_correctly(dst, src, local, [30, 4, 6])  # blocks from the wrong place
    dst["model.layers.1.self_attn.attn"].view(torch.int16)[1, 7, 3, 2, 9] ^= 1
    assert not pulled_correctly(dst, src, local, remote)  # one bit of one pulled block
    dst, src = _pulled(local, remote)
    dst["model.layers.0.self_attn.attn"].view(torch.int16)[0, 20, 0, 0, 0] = 0
    assert not pulled_correctly(dst, src, local, remote)  # a write outside the pulled blocks


def test_the_same_seed_gives_the_same_bytes_and_another_does_not() -> None:
    a, b, c = make_kv(1, 8, "cpu"), make_kv(1, 8, "cpu"), make_kv(1, 8, "cpu")
    fill_pattern(a, 3)
    fill_pattern(b, 3)
    fill_pattern(c, 4)
    name = next(iter(a))
    assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16))
    assert not torch.equal(a[name].view(torch.int16), c[name].view(torch.int16))


def test_block_sets_are_one_run_or_scattered_as_named() -> None:
    local, remote = block_sets("contiguous", 10, 64, seed=0)
    assert coalesce_runs(local, remote) == [(54, 0, 10)]
    local, remote = block_sets("scattered", 20, 64, seed=0)
    assert len(set(local)) == len(set(remote)) == 20
    assert local == sorted(local) and max(local + remote) < 64
    assert len(coalesce_runs(local, remote)) > 5  # fragmented, not one run


def test_a_variant_passes_only_when_every_check_did() -> None:
    row = {"layout": "contiguous", "mib": 1, "bytes": 2**20, "ops": 8, "ok": True,
           "pull_s": [0.001, 0.002, 0.001], "torch_s": [0.0005] * 3}
    small = {"blocks": 16, "bytes": 2**22, "ops": 128, "ok": True, "pull_s": [1e-4],
             "torch_s": [5e-5]}
    good = {"rows": [row], "small": small, "source_intact": True}
    assert passed(good)
    assert not passed({**good, "source_intact": False})
    assert not passed({**good, "rows": [{**row, "ok": False}]})
    assert not passed({"error": "boom"})
    assert not passed({**good, "expected_get_transport": "cuda_ipc",
                       "get_protocols": ["software emulation | tcp/lo"]})
    table = summarize("host", good)
    assert table[0]["ours_gbps"] == round(2**20 / 0.001 / 1e9, 2)
    assert table[0]["ours_over_torch"] == 0.5


# UCX_PROTO_INFO's tables as the H200 run printed them (timestamps cut; a put table, then
# the get table, its row a placeholder the test fills).
_PUT_THEN_GET = """\
[ts] [vm:770 :0] +--------+--------------------+----------------------------+
[ts] [vm:770 :0] | gpu-check-decode intra-node cfg#1                        |
[ts] [vm:770 :0] | remote memory write by ucp_put* from host memory to host |
[ts] [vm:770 :0] +--------+--------------------+----------------------------+
[ts] [vm:770 :0] | Range  |    Description     |           Config           |
[ts] [vm:770 :0] +--------+--------------------+----------------------------+
[ts] [vm:770 :0] | 0..inf | software emulation | tcp/lo                     |
[ts] [vm:770 :0] +--------+--------------------+----------------------------+
[ts] [vm:770 :0] +--------+--------------------+----------------------------------+
[ts] [vm:770 :0] | gpu-check-decode intra-node cfg#1                              |
[ts] [vm:770 :0] | remote memory read by ucp_get* into cuda/GPU0 from cuda/dev[0] |
[ts] [vm:770 :0] +--------+--------------------+----------------------------------+
[ts] [vm:770 :0] | Range  |    Description     |              Config              |
[ts] [vm:770 :0] +--------+--------------------+----------------------------------+
[ts] [vm:770 :0] | 0..inf | SOFTWARE            | TRANSPORT                        |
[ts] [vm:770 :0] +--------+--------------------+----------------------------------+
contiguous 1 MiB: ok=True pull 1.88 ms torch 0.05 ms
"""


def test_the_get_transport_is_read_from_ucx_tables_and_emulation_fails_a_cuda_ipc_variant() -> None:
    emulated = _PUT_THEN_GET.replace("SOFTWARE           ", "software emulation").replace(
        "TRANSPORT", "tcp/lo   ")
    ipc = _PUT_THEN_GET.replace("SOFTWARE", "zero-copy").replace("TRANSPORT", "cuda_ipc/cuda")
    assert get_protocols(emulated.splitlines()) == ["software emulation | tcp/lo"]  # not the put
    assert get_protocols(ipc.splitlines()) == ["zero-copy | cuda_ipc/cuda"]
    want = {"expected_get_transport": "cuda_ipc"}
    assert get_transport_ok({**want, "get_protocols": get_protocols(ipc.splitlines())})
    assert not get_transport_ok({**want, "get_protocols": get_protocols(emulated.splitlines())})
    assert not get_transport_ok({**want, "get_protocols": []})  # no table seen: not proven
    assert get_transport_ok({"get_protocols": get_protocols(emulated.splitlines())})  # staged


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU outcome")
def test_the_script_without_a_gpu_runs_the_host_part_then_fails_clearly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "PDSERVE_GPU_BUILD": str(tmp_path / "build"),
           "PDSERVE_GPU_SITE": str(tmp_path / "site"), "PDSERVE_GPU_CARRY": str(tmp_path / "none")}
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(out), "--host-sizes-mib", "1,4",
                           "--repeats", "2", "--small-repeats", "10"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == NO_GPU, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "NO GPU: torch.cuda.is_available() is False" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    host = report["variants"]["host"]
    assert passed(host) and [r["mib"] for r in host["rows"]] == [1, 1, 4, 4]
    assert set(host["memory_types"]) == {"host"} and host["path"] == "pvm"
    assert report["variants"]["cuda-auto"]["error"].startswith("no CUDA GPU")
    assert report["tests"]["rc"] == 0 and "skipped" in report["tests"]["summary"]
    assert (out / "gpu_check.log").read_text().count("== build the native extension") == 1
