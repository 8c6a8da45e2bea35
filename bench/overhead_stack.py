"""The processes of ``python -m bench.router_overhead``: a fake vLLM backend, and in front of it
pdserve's router (the backend registered in a real Redis as an aggregated worker) and
vllm-router (``--worker-urls``, ``--policy round_robin``), each pinned to its cores.

Readiness by health polling; cleanup by process handle.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from router.state.registry import WorkerRecord, WorkerRegistry
from serve.process import child_setup
from serve.redis_server import RedisServer, free_port, start_redis

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
WORKER_ID = "fake-0"
_SECRETS = ("PDSERVE_CLUSTER_SECRET", "PDSERVE_CLUSTER_SECRET_FILE")


@dataclass(frozen=True)
class Layout:
    """Which cores run what (the issue's: backend and client on core 0, routers on core 1)."""

    client_cpus: tuple[int, ...] = (0,)
    backend_cpus: tuple[int, ...] = (0,)
    router_cpus: tuple[int, ...] = (1,)

    @property
    def cores(self) -> set[int]:
        return {*self.client_cpus, *self.backend_cpus, *self.router_cpus}

    def describe(self) -> str:
        def cpus(c: tuple[int, ...]) -> str:
            return ",".join(map(str, c))
        return (f"client on core {cpus(self.client_cpus)}, backend and Redis on core "
                f"{cpus(self.backend_cpus)}, the router under test on core "
                f"{cpus(self.router_cpus)}")


@dataclass
class Stack:
    """The running processes; ``urls`` maps a setup name to the URL the client sends to."""

    layout: Layout
    model: str
    model_path: str
    urls: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    """Setup (or ``backend``, ``redis``) -> pid, for CPU accounting."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    redis: RedisServer | None = None

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.redis is not None:
            self.redis.stop()


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")


def vllm_router_binary() -> str:
    """vllm-router's console script (``pip install vllm-router``; the ``bench`` extra)."""
    found = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                        "vllm-router")
    if not os.path.exists(found):
        raise RuntimeError("vllm-router is not installed (pip install 'pdserve[bench]')")
    return found


def _spawn(stack: Stack, cmd: Sequence[str], cpus: tuple[int, ...],
           env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, preexec_fn=child_setup(cpus),
                            stdout=subprocess.DEVNULL, stderr=None)
    stack.procs.append(proc)
    return proc


async def _register(redis_url: str, record: WorkerRecord) -> None:
    registry = WorkerRegistry(redis_url, ttl_s=24 * 3600.0)  # no heartbeat during the run
    try:
        await registry.register(record)
    finally:
        await registry.close()


def start(layout: Layout, *, model: str, model_path: str, setups: Sequence[str],
          chunk_gap_ms: float = 0.0, pdserve_args: Sequence[str] = (),
          baseline_tree: Path | None = None) -> Stack:
    """Start the backend and every router of ``setups`` (``pdserve``, ``vllm-router``; with
    ``baseline_tree``, ``pdserve-base``: pdserve's router run from that source tree, another
    commit, for before/after in one run); returns when each answers its health check."""
    stack = Stack(layout, model, model_path)
    try:
        port = free_port()
        backend = f"http://{HOST}:{port}"
        proc = _spawn(stack, [sys.executable, "-m", "bench.fake_openai", "--host", HOST,
                              "--port", str(port), "--model", model,
                              "--chunk-gap-ms", str(chunk_gap_ms)], layout.backend_cpus)
        wait_ready(backend + "/health", proc)
        stack.urls["direct"], stack.pids["backend"] = backend, proc.pid
        trees = {"pdserve": ROOT, "pdserve-base": baseline_tree}
        for name, tree in trees.items():
            if name in setups and tree is not None:
                _start_pdserve(stack, backend, pdserve_args, name, tree)
        if "vllm-router" in setups:
            port = free_port()
            proc = _spawn(stack, [vllm_router_binary(), "--host", HOST, "--port", str(port),
                                  "--worker-urls", backend, "--policy", "round_robin",
                                  "--prometheus-port", str(free_port()),
                                  "--worker-startup-check-interval", "1",
                                  "--log-level", "warning"], layout.router_cpus)
            url = f"http://{HOST}:{port}"
            wait_ready(url + "/health", proc)
            stack.urls["vllm-router"], stack.pids["vllm-router"] = url, proc.pid
    except BaseException:
        stack.stop()
        raise
    return stack


def _start_pdserve(stack: Stack, backend: str, extra: Sequence[str], name: str,
                   tree: Path) -> None:
    layout = stack.layout
    if stack.redis is None:
        stack.redis = start_redis()
        os.sched_setaffinity(stack.redis.process.pid, layout.backend_cpus)
        stack.pids["redis"] = stack.redis.process.pid
        record = WorkerRecord(worker_id=WORKER_ID, role="aggregated", model=stack.model,
                              model_path=stack.model_path, http_url=backend,
                              engine_id=f"engine-{WORKER_ID}", ucx_address="",
                              max_model_len=4096, started_at=time.time())
        asyncio.run(_register(stack.redis.url, record))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
    proc = _spawn(stack, [sys.executable, "-m", "router.main", "--host", HOST, "--port",
                          str(port), "--redis-url", stack.redis.url, "--log-level", "WARNING",
                          *extra], layout.router_cpus, env, cwd=tree)
    url = f"http://{HOST}:{port}"
    wait_ready(url + "/health", proc)  # 200 once the worker is seen and its tokenizer loaded
    stack.urls[name], stack.pids[name] = url, proc.pid
