"""Session fixtures: a real `pdserve up` cluster and a plain vLLM server on the tiny model.

Both start once per session (each vLLM start costs ~1 minute of a 2-core machine) and in
parallel. A second cluster on the NIXL transport starts only for the tests parametrized over
`pd_cluster` (equivalence, negative control, lease expiry and late pull), which run last.
`pdserve up` is pointed at a Redis URL where nothing listens, so it starts its own Redis, as a
user's first `make run` does.
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
TRANSPORTS = ("ucx", "nixl")
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
    transport: str = "ucx"
    """The workers' KV transport (`pdserve worker --kv-transport`)."""
    ready: threading.Event = field(default_factory=threading.Event)

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


def _launch_cluster(model_dir: Path, tmp: Path, transport: str) -> Cluster:
    """Start `pdserve up` with workers on ``transport``; returns before it is ready."""
    port = free_port()
    flag = tmp / "corrupt-pulled-kv"
    traces = OtlpReceiver()
    router_timeline, kv_timeline = tmp / "router-timeline.jsonl", tmp / "kv-timeline.jsonl"
    cmd = [sys.executable, "-m", "serve.cli", "up", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--port", str(port),
           "--redis", f"redis://127.0.0.1:{free_port()}/0", "--lease-s", str(LEASE_S),
           f"--worker-arg=--kv-transport={transport}",
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
                      keyring_file=keyring_file, transport=transport)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            cluster.output.append(line)
            sys.stderr.write(line)
            match = re.search(r"pdserve ready: .* redis (\S+)\)", line)
            if match:
                cluster.redis_url = match.group(1)
                cluster.ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return cluster


def _await_cluster(cluster: Cluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not cluster.ready.wait(1.0):
        if cluster.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("pdserve up failed to start:\n" + "".join(cluster.output[-50:]))


def _stop_cluster(cluster: Cluster) -> None:
    """Ctrl-C, then check that every child stopped cleanly: exit code 0, each worker
    deregistered itself (a leave event before `up` stopped its Redis), nothing left listening."""
    proc = cluster.proc
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
    assert code == 0, "".join(cluster.output[-30:])
    assert leaves is not None and len(leaves.stop()) == len(worker_urls) == 2
    assert not any(_port_open(u) for u in [*worker_urls, cluster.url])
    if cluster.traces is not None:
        cluster.traces.close()


@pytest.fixture(scope="session")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Cluster, Plain]]:
    plain_port = free_port()
    plain_proc = subprocess.Popen(
        vllm_command(str(tiny_model_dir), "127.0.0.1", plain_port, SERVED_NAME, None, None),
        env=vllm_env(1), start_new_session=True)
    plain = Plain(plain_proc, f"http://127.0.0.1:{plain_port}")
    cluster = _launch_cluster(tiny_model_dir, tmp_path_factory.mktemp("cluster"), "ucx")
    try:
        asyncio.run(wait_healthy(plain.url, plain_proc, START_TIMEOUT_S))
        _await_cluster(cluster)
        yield cluster, plain
    finally:
        stop_process(plain_proc)
        _stop_cluster(cluster)


@pytest.fixture(scope="session")
def nixl_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Cluster]:
    """A second `pdserve up` whose workers use the NIXL transport (`--kv-transport nixl`).

    Started on first use; `pytest_collection_modifyitems` runs its tests last, so it idles
    beside the UCX cluster only for them."""
    cluster = _launch_cluster(tiny_model_dir, tmp_path_factory.mktemp("nixl-cluster"), "nixl")
    try:
        _await_cluster(cluster)
        yield cluster
    finally:
        _stop_cluster(cluster)


@pytest.fixture(params=TRANSPORTS)
def pd_cluster(request: pytest.FixtureRequest) -> Cluster:
    """The P/D cluster of each KV transport, for the tests that must hold on both wires."""
    return request.getfixturevalue("cluster" if request.param == "ucx" else "nixl_cluster")


@pytest.fixture
def pd_workers(pd_cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of ``pd_cluster``'s workers (from its Redis registry)."""
    return registered_workers(pd_cluster)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the NIXL cluster's tests last (stable order otherwise): its two workers then share
    the cores with the other clusters only while those tests run."""
    def on_nixl(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get("pd_cluster") == "nixl"

    items.sort(key=on_nixl)


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


def registered_workers(cluster: Cluster) -> dict[str, str]:
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


@pytest.fixture(scope="session")
def workers(cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of the UCX cluster's workers."""
    return registered_workers(cluster)
