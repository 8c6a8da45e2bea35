"""Session fixtures: a real `pdserve up` cluster and a plain vLLM server on the tiny model.

Both start once per session (each vLLM start costs ~1 minute of a 2-core machine) and in
parallel. `pdserve up` is pointed at a Redis URL where nothing listens, so it starts its own
Redis, as a user's first `make run` does.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtransfer.signing import Keyring, strip_signature
from serve.redis_server import free_port
from serve.tiny_model import build_tiny_model
from serve.worker import stop_process, vllm_command, vllm_env, wait_healthy
from tests.support.otlp import OtlpReceiver

SERVED_NAME = "tiny-llama"
LEASE_S = 8.0
START_TIMEOUT_S = 600.0


@dataclass
class Cluster:
    """A running `pdserve up`."""

    proc: subprocess.Popen[str]
    url: str
    redis_url: str = ""
    corrupt_flag: Path = field(default_factory=Path)
    output: list[str] = field(default_factory=list)
    router_timeline: Path = field(default_factory=Path)
    """JSON lines of the router's request timelines (``--timeline-file``)."""
    kv_timeline: Path = field(default_factory=Path)
    """JSON lines of both workers' connector timelines."""
    traces: OtlpReceiver | None = None
    """Receives the OTLP traces of the router and both vLLM workers."""
    keyring_file: Path = field(default_factory=Path)
    """The cluster secret every process shares: tests that play the router sign with it."""

    def sign(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` signed as the router signs them (kvtransfer.signing)."""
        keyring = Keyring.parse(self.keyring_file.read_text())
        return keyring.sign(strip_signature(params), time.time())


@dataclass
class Plain:
    """A plain vLLM server (no connector): the reference outputs."""

    proc: subprocess.Popen[bytes]
    url: str


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_tiny_model()


def _port_open(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


@pytest.fixture(scope="session")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Cluster, Plain]]:
    tmp = tmp_path_factory.mktemp("cluster")
    plain_port = free_port()
    plain_proc = subprocess.Popen(
        vllm_command(str(tiny_model_dir), "127.0.0.1", plain_port, SERVED_NAME, None, None),
        env=vllm_env(1), start_new_session=True)
    plain = Plain(plain_proc, f"http://127.0.0.1:{plain_port}")

    port = free_port()
    flag = tmp / "corrupt-pulled-kv"
    traces = OtlpReceiver()
    router_timeline, kv_timeline = tmp / "router-timeline.jsonl", tmp / "kv-timeline.jsonl"
    cmd = [sys.executable, "-m", "serve.cli", "up", "--model", str(tiny_model_dir),
           "--served-model-name", SERVED_NAME, "--port", str(port),
           "--redis", f"redis://127.0.0.1:{free_port()}/0", "--lease-s", str(LEASE_S),
           f"--worker-arg=--corrupt-pulled-kv-file={flag}",
           f"--worker-arg=--timeline-file={kv_timeline}",
           f"--router-arg=--timeline-file={router_timeline}",
           "--otlp-traces-endpoint", traces.endpoint]
    keyring_file = tmp / "keyring"
    keyring_file.write_text(secrets.token_urlsafe(32) + "\n")
    keyring_file.chmod(0o600)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_CLUSTER_SECRET_FILE": str(keyring_file),
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    cluster = Cluster(proc, f"http://127.0.0.1:{port}", corrupt_flag=flag,
                      router_timeline=router_timeline, kv_timeline=kv_timeline, traces=traces,
                      keyring_file=keyring_file)
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            cluster.output.append(line)
            sys.stderr.write(line)
            match = re.search(r"pdserve ready: .* redis (\S+)\)", line)
            if match:
                cluster.redis_url = match.group(1)
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        asyncio.run(wait_healthy(plain.url, plain_proc, START_TIMEOUT_S))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("pdserve up failed to start:\n" + "".join(cluster.output[-50:]))
        yield cluster, plain
    finally:
        stop_process(plain_proc)
        worker_urls = re.findall(r'"url": "(http://[^"]+)"', "".join(cluster.output))
        leaves = _LeaveListener(cluster.redis_url) if cluster.redis_url else None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError("pdserve up did not stop within 120 s of Ctrl-C") from None
    # Ctrl-C stops every child cleanly: exit code 0, each worker deregistered itself (a leave
    # event before `up` stopped its Redis), no worker or router left listening.
    assert code == 0, "".join(cluster.output[-30:])
    assert leaves is not None and len(leaves.stop()) == len(worker_urls) == 2
    assert not any(_port_open(u) for u in [*worker_urls, cluster.url])
    traces.close()


class _LeaveListener:
    """Collects registry "leave" events in a thread until stop()."""

    def __init__(self, redis_url: str) -> None:
        import redis

        self._pubsub = redis.Redis.from_url(redis_url).pubsub()
        self._pubsub.subscribe("pdserve:events")
        self.worker_ids: set[str] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import json

        import redis

        try:
            for message in self._pubsub.listen():
                if message["type"] == "message":
                    event = json.loads(message["data"])
                    if event.get("type") == "leave":
                        self.worker_ids.add(event["worker_id"])
        except (redis.RedisError, ValueError, OSError):
            return  # `up` stopped its Redis

    def stop(self) -> set[str]:
        self._thread.join(timeout=10)
        return self.worker_ids


@pytest.fixture(scope="session")
def cluster(servers: tuple[Cluster, Plain]) -> Cluster:
    return servers[0]


@pytest.fixture(scope="session")
def plain(servers: tuple[Cluster, Plain]) -> Plain:
    return servers[1]


@pytest.fixture(scope="session")
def workers(cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of the cluster's workers, read from the real Redis registry."""
    from router.state.registry import WorkerRegistry

    async def read() -> dict[str, str]:
        registry = WorkerRegistry(cluster.redis_url)
        try:
            return {r.role: r.http_url for r in await registry.list()}
        finally:
            await registry.close()

    found = asyncio.run(read())
    assert set(found) == {"prefill", "decode"}, found
    return found
