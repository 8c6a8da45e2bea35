"""The one way tests start a pdserve cluster (`pdserve up`) and the plain vLLM reference.

A start is split in two (``launch_*`` returns at once, ``await_*`` blocks until ready) so a
session can boot a cluster and the reference side by side; :func:`running_cluster` joins
launch, await and stop for a test that needs one cluster. `pdserve up` is pointed at a Redis
URL where nothing listens, so it starts its own Redis, as a user's first `make run` does.
Cleanup is by process handle, never by name.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtransfer.signing import Keyring, strip_signature
from serve.plain_vllm import start_plain_vllm
from serve.redis_server import free_port
from serve.worker import stop_process, wait_healthy
from tests.support.otlp import OtlpReceiver

SERVED_NAME = "tiny-llama"
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
_READY = re.compile(r"pdserve ready: .* redis (\S+)\)")
_STARTED = re.compile(r"started \w+ worker at (http://\S+)")
_RESTARTING = re.compile(r"\w+ worker (http://\S+) .*; restarting in")
"""`up`'s own line for each worker it starts (in the terminal whatever ``--log-dir`` says)."""
_OWN_LINE = re.compile(r"^(pdserve |\S+ \S+ (DEBUG|INFO|WARNING|ERROR) serve\.|\s*$)")
"""A line `pdserve up` itself prints: its summary lines, its own log lines, a blank line."""


def foreign_lines(lines: Sequence[str]) -> list[str]:
    """The lines of ``lines`` that `pdserve up` did not print itself (a child's output)."""
    return [line for line in lines if not _OWN_LINE.match(line)]


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
    log_dir: Path | None = None
    """Where its children write (``--log-dir``); None: into ``output`` with `up`'s own lines."""
    ready: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None
    """Reads `up`'s output into ``output`` until it closes."""

    @property
    def worker_auth(self) -> dict[str, str]:
        """The header the router sends its workers' vLLM (``/v1`` takes nothing else)."""
        keyring = Keyring.parse(self.keyring_file.read_text())
        return {"authorization": f"Bearer {keyring.worker_api_keys[0]}"}

    engines: dict[str, str] = field(default_factory=dict)
    """HTTP URL -> engine id of the registered workers (read on first use)."""

    def sign(self, params: dict[str, Any], worker_url: str) -> dict[str, Any]:
        """``params`` signed as the router signs them for one call to the worker at
        ``worker_url`` (kvtransfer.signing: bound to its engine id, accepted once)."""
        if worker_url not in self.engines:
            self.engines.update(registered_engines(self))
        keyring = Keyring.parse(self.keyring_file.read_text())
        return keyring.sign(strip_signature(params), time.time(),
                            target=self.engines[worker_url])


@dataclass
class Plain:
    """A plain vLLM server (no connector): the reference outputs."""

    proc: subprocess.Popen[bytes]
    url: str


def launch_cluster(model_dir: Path, tmp: Path, *, transport: str | None = None,
                   lease_s: float | None = None, instrument: bool = False,
                   extra_args: Sequence[str] = (), log_dir: Path | None = None) -> Cluster:
    """Start `pdserve up` on ``model_dir``; returns before it is ready.

    ``transport`` and ``lease_s`` go to the workers when given (otherwise `up`'s defaults);
    ``instrument`` adds a keyring file the test can sign with, both timeline files, an OTLP
    receiver for traces and the workers' corrupt-pulled-KV flag file (created only by a test);
    ``extra_args`` are appended to `pdserve up`'s command line (pool sizes, ``--autoscale``);
    ``log_dir`` takes the children's output (default: the terminal, so a failing test shows
    it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.cli", "up", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--port", str(port),
           "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
           "--log-dir", "-" if log_dir is None else str(log_dir)]
    if lease_s is not None:
        cmd += ["--lease-s", str(lease_s)]
    if transport is not None:
        cmd.append(f"--worker-arg=--kv-transport={transport}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cluster_fields: dict[str, Any] = {"transport": transport or "ucx", "log_dir": log_dir}
    if instrument:
        flag, keyring_file = tmp / "corrupt-pulled-kv", tmp / "keyring"
        router_timeline, kv_timeline = tmp / "router-timeline.jsonl", tmp / "kv-timeline.jsonl"
        traces = OtlpReceiver()
        cmd += [f"--worker-arg=--corrupt-pulled-kv-file={flag}",
                f"--worker-arg=--timeline-file={kv_timeline}",
                f"--router-arg=--timeline-file={router_timeline}",
                "--otlp-traces-endpoint", traces.endpoint]
        keyring_file.write_text(secrets.token_urlsafe(32) + "\n")
        keyring_file.chmod(0o600)
        env.update({"PDSERVE_CLUSTER_SECRET_FILE": str(keyring_file),
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        cluster_fields.update(corrupt_flag=flag, router_timeline=router_timeline,
                              kv_timeline=kv_timeline, traces=traces, keyring_file=keyring_file)
    proc = subprocess.Popen([*cmd, *extra_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    cluster = Cluster(proc, f"http://127.0.0.1:{port}", **cluster_fields)
    cluster.pump = threading.Thread(target=_pump, args=(cluster,), daemon=True)
    cluster.pump.start()
    return cluster


def _pump(cluster: Cluster) -> None:
    """Echo `up`'s output to stderr, keep it, and catch its "ready" line (with its Redis)."""
    assert cluster.proc.stdout is not None
    for line in cluster.proc.stdout:
        cluster.output.append(line)
        sys.stderr.write(line)
        match = _READY.search(line)
        if match:
            cluster.redis_url = match.group(1)
            cluster.ready.set()


def await_cluster(cluster: Cluster, timeout_s: float = START_TIMEOUT_S) -> None:
    """Block until `up` prints that it is ready; fail with its last output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while not cluster.ready.wait(1.0):
        if cluster.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("pdserve up failed to start:\n" + "".join(cluster.output[-50:])
                               + _log_tails(cluster))


def _log_tails(cluster: Cluster, lines: int = 30) -> str:
    """The end of each child's log file, when the children write to files."""
    if cluster.log_dir is None or not cluster.log_dir.is_dir():
        return ""
    out = []
    for path in sorted(cluster.log_dir.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"\n--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "".join(out)


def stop_cluster(cluster: Cluster, *, expect_workers: int | None = None) -> None:
    """Ctrl-C `up` and wait for it (SIGKILL of its group after STOP_TIMEOUT_S).

    With ``expect_workers``, also check that it stopped cleanly: within STOP_TIMEOUT_S, exit
    code 0, that many workers, each deregistered itself (a leave event before `up` stopped its
    Redis), nothing left listening."""
    proc = cluster.proc
    output = "".join(cluster.output)
    worker_urls = _STARTED.findall(output)
    replaced = _RESTARTING.findall(output)  # crashed (or killed by a test) and restarted
    check = expect_workers is not None
    leaves = _LeaveListener(cluster.redis_url) if check and cluster.redis_url else None
    interrupted_at = len(cluster.output)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if check:
            raise AssertionError(f"pdserve up did not stop within {STOP_TIMEOUT_S} s of Ctrl-C"
                                 ) from None
        return
    finally:
        if cluster.traces is not None:
            cluster.traces.close()
    if expect_workers is not None:
        assert code == 0, "".join(cluster.output[-30:]) + _log_tails(cluster)
        if cluster.pump is not None:
            cluster.pump.join(timeout=10)
        if cluster.log_dir is not None:  # a quiet stop: no child's exit chatter in the terminal
            assert foreign_lines(cluster.output[interrupted_at:]) == [], "".join(
                cluster.output[interrupted_at:])
        # one closing line counts what it stopped: router, the workers, the Redis it started
        assert any(line.startswith(f"pdserve stopped ({expect_workers + 2} processes)")
                   for line in cluster.output[-20:]), "".join(cluster.output[-20:])
        assert leaves is not None
        assert len(leaves.stop()) == len(worker_urls) - len(replaced) == expect_workers, (
            worker_urls, replaced)
        assert not any(_port_open(u) for u in [*worker_urls, cluster.url])


@contextmanager
def running_cluster(model_dir: Path, tmp: Path, *, expect_workers: int | None = None,
                    **launch: Any) -> Iterator[Cluster]:
    """A ready cluster for the ``with`` block (``launch`` as :func:`launch_cluster` takes it);
    stopped after, checked as :func:`stop_cluster` checks with ``expect_workers``."""
    cluster = launch_cluster(model_dir, tmp, **launch)
    try:
        await_cluster(cluster)
        yield cluster
    finally:
        stop_cluster(cluster, expect_workers=expect_workers)


def launch_plain(model_dir: Path) -> Plain:
    """Start the plain vLLM reference on ``model_dir``; returns before it is healthy."""
    proc, url = start_plain_vllm(str(model_dir), SERVED_NAME)
    return Plain(proc, url)


def await_plain(plain: Plain, timeout_s: float = START_TIMEOUT_S) -> None:
    """Block until the reference answers /health; fail if it exits first."""
    asyncio.run(wait_healthy(plain.url, plain.proc, timeout_s))


def stop_plain(plain: Plain) -> None:
    """SIGTERM the reference (SIGKILL if it lingers)."""
    stop_process(plain.proc)


@contextmanager
def running_plain(model_dir: Path) -> Iterator[Plain]:
    """A healthy plain vLLM reference for the ``with`` block."""
    plain = launch_plain(model_dir)
    try:
        await_plain(plain)
        yield plain
    finally:
        stop_plain(plain)


def registered_records(cluster: Cluster) -> list[Any]:
    """The cluster's ``WorkerRecord``s, read from the real Redis registry."""
    from router.state.registry import WorkerRegistry

    async def read() -> list[Any]:
        registry = WorkerRegistry(cluster.redis_url)
        try:
            return list(await registry.list())
        finally:
            await registry.close()

    return asyncio.run(read())


def registered_engines(cluster: Cluster) -> dict[str, str]:
    """HTTP URL -> engine id of the cluster's workers (the real Redis registry)."""
    return {r.http_url: r.engine_id for r in registered_records(cluster)}


def registered_workers(cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of the cluster's workers (the real Redis registry)."""
    found = {r.role: r.http_url for r in registered_records(cluster)}
    assert set(found) == {"prefill", "decode"}, found
    return found


def _port_open(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


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
