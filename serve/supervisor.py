"""`pdserve up`: the embedded local cluster (Redis if needed, prefill and decode workers, router).

Every child runs in its own process group so a Ctrl-C reaches only the supervisor, which then
stops the router first (no new requests), then the workers (each deregisters itself), then the
Redis it started. Readiness is the router's ``/health`` turning 200, which needs at least one
registered worker of each role.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import httpx

from serve.redis_server import RedisServer, free_port, redis_reachable, start_redis
from serve.worker import stop_process

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "tiny-llama"


@dataclass(frozen=True)
class ClusterSettings:
    """Shape of the local cluster."""

    model: str | None = None
    """Model dir or HF id; None builds and serves the tiny offline model."""
    served_model_name: str | None = None
    prefill: int = 1
    decode: int = 1
    port: int = 8000
    host: str = "127.0.0.1"
    redis_url: str = "redis://127.0.0.1:6379/0"
    policy: str = "round_robin"
    lease_s: float = 30.0
    kv_cache_gib: float = 1.0
    ready_timeout_s: float = 900.0
    worker_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode must be >= 1")


class Cluster:
    """Owns the child processes of one local cluster."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.redis: RedisServer | None = None
        self.redis_url = settings.redis_url
        self.workers: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.model = settings.model
        self.served_name = settings.served_model_name or (
            DEFAULT_SERVED_NAME if settings.model is None else settings.model)

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def start(self) -> None:
        """Start Redis (when unreachable), the workers and the router; returns at once."""
        s = self.settings
        if self.model is None:
            from serve.tiny_model import build_tiny_model

            self.model = str(build_tiny_model())
        if not redis_reachable(self.redis_url):
            self.redis = start_redis()
            self.redis_url = self.redis.url
            logger.info("no Redis at %s: started one at %s", s.redis_url, self.redis_url)
        for role, count in (("prefill", s.prefill), ("decode", s.decode)):
            for _ in range(count):
                self.workers.append(self._spawn_worker(role))
        cmd = [sys.executable, "-m", "router.main", "--host", s.host, "--port", str(s.port),
               "--redis", self.redis_url, "--policy", s.policy]
        self.router = subprocess.Popen(cmd, start_new_session=True)

    def _spawn_worker(self, role: str) -> subprocess.Popen[bytes]:
        s = self.settings
        assert self.model is not None
        cmd = [sys.executable, "-m", "serve.cli", "worker", "--role", role, "--model", self.model,
               "--served-model-name", self.served_name, "--redis", self.redis_url,
               "--port", str(free_port(s.host)), "--host", s.host, "--lease-s", str(s.lease_s),
               "--kv-cache-gib", str(s.kv_cache_gib), *s.worker_args]
        return subprocess.Popen(cmd, start_new_session=True)

    async def wait_ready(self) -> None:
        """Wait until the router reports both pools live; fail if a child dies first."""
        deadline = asyncio.get_running_loop().time() + self.settings.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while asyncio.get_running_loop().time() < deadline:
                dead = [p for p in [*self.workers, self.router] if p and p.poll() is not None]
                if dead:
                    raise RuntimeError(f"{len(dead)} cluster process(es) exited during start-up")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise TimeoutError(f"cluster not ready within {self.settings.ready_timeout_s} s")

    def children_alive(self) -> bool:
        return all(p.poll() is None for p in [*self.workers, self.router] if p is not None)

    def stop(self) -> None:
        """Router first, then workers (they deregister), then our Redis."""
        if self.router is not None:
            stop_process(self.router, timeout_s=10)
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            stop_process(proc, timeout_s=30)
        if self.redis is not None:
            self.redis.stop()


async def run_cluster(settings: ClusterSettings) -> int:
    """`pdserve up` in the foreground: start, print the URL when ready, stop on a signal."""
    cluster = Cluster(settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    cluster.start()
    try:
        ready = asyncio.create_task(cluster.wait_ready())
        stop = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stop in done:
            ready.cancel()
            return 130
        stop.cancel()
        ready.result()
        print(f"pdserve ready: {cluster.url}/v1 (model {cluster.served_name}, "
              f"{settings.prefill} prefill + {settings.decode} decode, redis {cluster.redis_url})",
              flush=True)
        while not stopping.is_set():
            if not cluster.children_alive():
                logger.error("a cluster process exited; stopping the cluster")
                return 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=1.0)
        return 0
    finally:
        await asyncio.to_thread(cluster.stop)


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve up` (each mirrors a PDSERVE_* env var)."""
    env = os.environ.get
    parser.add_argument("--model", default=env("PDSERVE_MODEL"),
                        help="model dir or HF id (default: the tiny offline model)")
    parser.add_argument("--served-model-name", default=env("PDSERVE_SERVED_MODEL_NAME"))
    parser.add_argument("--prefill", type=int, default=int(env("PDSERVE_PREFILL", "1")))
    parser.add_argument("--decode", type=int, default=int(env("PDSERVE_DECODE", "1")))
    parser.add_argument("--port", type=int, default=int(env("PDSERVE_PORT", "8000")))
    parser.add_argument("--host", default=env("PDSERVE_HOST", "127.0.0.1"))
    parser.add_argument("--redis", default=env("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--policy", default=env("PDSERVE_POLICY", "round_robin"))
    parser.add_argument("--lease-s", type=float, default=float(env("PDSERVE_KV_LEASE_S", "30")))
    parser.add_argument("--kv-cache-gib", type=float,
                        default=float(env("PDSERVE_WORKER_KV_CACHE_GIB", "1")))
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to every `pdserve worker` (repeatable)")


def settings_from_args(args: argparse.Namespace) -> ClusterSettings:
    """ClusterSettings from parsed `pdserve up` flags."""
    return ClusterSettings(model=args.model, served_model_name=args.served_model_name,
                           prefill=args.prefill, decode=args.decode, port=args.port,
                           host=args.host, redis_url=args.redis, policy=args.policy,
                           lease_s=args.lease_s, kv_cache_gib=args.kv_cache_gib,
                           worker_args=tuple(args.worker_arg))
