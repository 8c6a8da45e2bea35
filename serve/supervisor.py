"""`pdserve up`: the embedded local cluster (Redis if needed, prefill and decode workers, router).

Every child runs in its own process group so a Ctrl-C reaches only the supervisor, which then
stops the router first (no new requests), then the workers (each deregisters itself), then the
Redis it started. A child that crashes is restarted with exponential backoff (1 s doubling to
30 s, reset after a minute of uptime) and the reason (exit code or signal) is logged; children
die with the supervisor (``PR_SET_PDEATHSIG``); vLLM's own engine processes may outlive a
launcher killed with -9 (a known gap, see README).
Readiness is the router's ``/health`` turning 200, which needs at least one registered worker
of each role.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router import settings as shared
from router.autoscale.actuators import DesiredReplicas
from router.state.registry import WorkerRegistry
from serve.child_logs import ChildLogs, default_root, new_run_dir
from serve.cpu_layout import CpuPlan, cpu_list, plan_cpus
from serve.errors import StartupError
from serve.listener import listening_socket
from serve.preflight import check_model, check_policies, check_port_free
from serve.process import child_setup
from serve.redis_server import RedisServer, ensure_redis, free_port, redacted_url
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
    """Prefill workers (with ``autoscale``: the pool's maximum)."""
    decode: int = 1
    """Decode workers (with ``autoscale``: the pool's maximum)."""
    port: int = 8000
    host: str = "127.0.0.1"
    redis_url: str = shared.default("redis_url")
    policy: str = shared.default("policy")
    """Prefill placement policy of the router (see router.policy.registry)."""
    lease_s: float = shared.default("kv_lease_s")
    kv_cache_gib: float = 1.0
    ready_timeout_s: float = 900.0
    worker_args: tuple[str, ...] = field(default_factory=tuple)
    autoscale: bool = False
    """Start one worker per pool and let `pdserve autoscale` size the pools."""
    autoscale_args: tuple[str, ...] = field(default_factory=tuple)
    drain_timeout_s: float = 300.0
    aggregated: int = 0
    """Plain (non-disaggregated) vLLM workers beside the P/D pools; with ``prefill`` and
    ``decode`` 0 the cluster is aggregated only (``--mode aggregated --replicas N``)."""
    flex: int = 0
    """Flex workers (``--mode adaptive --replicas N``): engines the router uses whole, as a
    prefill or as a decode, request by request."""
    cpu_layout: str = "auto"
    """``auto``: each engine on its own cores when there are enough (see serve.cpu_layout);
    ``float``: every engine on every core."""
    router_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra arguments of the router process (``python -m router.main``)."""
    otlp_traces_endpoint: str | None = None
    """OTLP endpoint given to the router and every worker: one trace per request."""
    kv_events: bool = False
    """Prefill and aggregated workers publish their KV cache events (each on a free port) and
    the router follows them (``--kv-events``)."""
    quiet_workers: bool = True
    """vLLM's own start-up chatter (its WARNING lines, FutureWarnings, the resource tracker's
    exit note) stays out of the terminal; off with ``--log-level DEBUG``."""
    log_dir: str | None = None
    """Each child's output goes to ``<log_dir>/<child>.log`` (``auto``: a new run directory
    under ``serve.child_logs.default_root()``); None: to the terminal."""
    passed_on: tuple[tuple[str, Any], ...] = ()
    """Shared settings (``router.settings``) given by flag or env, as (name, value): each child
    that takes one (router, workers, autoscaler) gets it as its canonical flag."""

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.aggregated, self.flex) < 0:
            raise ValueError("worker counts must be >= 0")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError("--prefill and --decode must both be >= 1 (or both 0 with "
                             "aggregated workers)")
        if self.prefill + self.aggregated + self.flex == 0:
            raise ValueError("the cluster needs a prefill and a decode worker, an "
                             "aggregated one or a flex one")
        if self.autoscale and self.prefill == 0:
            raise ValueError("--autoscale sizes P/D pools; it needs --prefill and --decode")
        if self.cpu_layout not in ("auto", "float"):
            raise ValueError(f"--cpu-layout must be auto or float, got {self.cpu_layout!r}")


@dataclass
class WorkerProc:
    """One `pdserve worker` child."""

    role: str
    url: str
    proc: subprocess.Popen[bytes]
    draining: bool = False
    cpus: tuple[int, ...] = ()
    """Cores the worker (and its vLLM engine) may run on; empty = all."""
    started_at: float = field(default_factory=time.monotonic)
    failures: int = 0
    """Consecutive crashes of this pool slot (reset once a worker ran ``STABLE_S``)."""

    @property
    def log_name(self) -> str:
        """Its log file's name (``serve.child_logs``): role and port."""
        return f"{self.role}-{self.url.rsplit(':', 1)[1]}"


QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore:resource_tracker:UserWarning",
}
"""Children's environment of a quiet start (each variable only where the user set none)."""

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Hosts for which `pdserve up` confines the workers' UCX to the loopback interface."""

STABLE_S = 60.0
"""A child that ran this long before crashing starts its backoff again from the first step."""


def restart_delay_s(failures: int, *, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Backoff before restarting a child after its ``failures``-th consecutive crash."""
    return min(cap_s, base_s * 2 ** max(0, failures - 1))


def exit_reason(code: int | None) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` for a Popen return code."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class PendingRestart:
    """A crashed child waiting for its backoff to pass."""

    role: str
    due: float
    failures: int


class Cluster:
    """Owns the child processes of one local cluster and reconciles pool sizes."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.redis: RedisServer | None = None
        self.redis_url = settings.redis_url
        self.workers: list[WorkerProc] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.autoscaler: subprocess.Popen[bytes] | None = None
        self.model = settings.model
        self.served_name = settings.served_model_name or (
            DEFAULT_SERVED_NAME if settings.model is None else settings.model)
        self._drains: set[asyncio.Task[None]] = set()
        self._pending: list[PendingRestart] = []
        self._router_cmd: list[str] = []
        self._listener: socket.socket | None = None
        """The router's listening socket, kept across router restarts (serve.listener)."""
        self._autoscaler_cmd: list[str] = []
        self.restarts: dict[str, int] = {}
        """Restarts so far by role (router, autoscaler, prefill, decode, aggregated)."""
        self._secret_dir: tempfile.TemporaryDirectory[str] | None = None
        self._events_dir: tempfile.TemporaryDirectory[str] | None = None
        self.logs = ChildLogs(None)
        """Where each child writes (its log file once ``start`` made the run directory)."""
        self.env = self._cluster_env()
        """Environment of every child: the cluster keyring that signs kv_transfer_params."""
        self.cpu_plan: CpuPlan = plan_cpus(sorted(os.sched_getaffinity(0)),
                                           settings.prefill + settings.decode
                                           + settings.aggregated + settings.flex,
                                           settings.cpu_layout)

    def _cluster_env(self) -> dict[str, str]:
        """Children share one keyring: the user's (``PDSERVE_CLUSTER_SECRET[_FILE]``) or a
        fresh random secret in a 0600 file, so only this router can make workers lease or read."""
        env = dict(os.environ)
        if self.settings.quiet_workers:
            env.update({name: value for name, value in QUIET_ENV.items() if name not in env})
        if self.settings.log_dir is not None:  # a log file ends with the child's last words
            env.setdefault("PYTHONUNBUFFERED", "1")
        if self.settings.host in LOOPBACK_HOSTS and "UCX_NET_DEVICES" not in env:
            # UCX over tcp serves RMA to whoever reaches its port (docs/security.md): a cluster
            # on loopback keeps UCX's listeners there too, off every other interface
            env["UCX_NET_DEVICES"] = "lo"
        if env.get("PDSERVE_CLUSTER_SECRET") or env.get("PDSERVE_CLUSTER_SECRET_FILE"):
            return env
        self._secret_dir = tempfile.TemporaryDirectory(prefix="pdserve-cluster-")
        path = os.path.join(self._secret_dir.name, "keyring")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        env["PDSERVE_CLUSTER_SECRET_FILE"] = path
        return env

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def _kv_events_args(self, name: str) -> list[str]:
        """Where a worker publishes its KV events: on loopback, a Unix socket in a directory
        only this uid may open (the events carry prompt token ids, and vLLM binds a port on
        every interface); elsewhere a port and a replay port."""
        s = self.settings
        if s.host not in LOOPBACK_HOSTS:
            return ["--kv-events-port", str(free_port(s.host)),
                    "--kv-events-replay-port", str(free_port(s.host))]
        if self._events_dir is None:
            self._events_dir = tempfile.TemporaryDirectory(prefix="pdserve-kv-events-")
        return ["--kv-events-ipc", os.path.join(self._events_dir.name, f"{name}.sock")]

    def start(self) -> None:
        """Start Redis (when unreachable), the workers and the router; returns at once."""
        s = self.settings
        if self.model is None:
            from serve.tiny_model import build_tiny_model

            self.model = str(build_tiny_model())
        try:
            self._listener = listening_socket(s.host, s.port)
        except OSError as exc:
            raise StartupError(f"cannot bind the router to {s.host}:{s.port}: "
                               f"{exc.strerror or exc}") from exc
        if s.log_dir is not None:
            self.logs = ChildLogs(new_run_dir(default_root(), s.port) if s.log_dir == "auto"
                                  else Path(s.log_dir))
        try:
            self.redis, self.redis_url = ensure_redis(s.redis_url)
        except RuntimeError as exc:  # redis-server missing or not answering
            raise StartupError(str(exc)) from exc
        for role, count in (("prefill", s.prefill), ("decode", s.decode),
                            ("aggregated", s.aggregated), ("flex", s.flex)):
            for _ in range(min(1, count) if s.autoscale and role in ("prefill", "decode")
                           else count):
                self.spawn_worker(role)
        logger.info("CPU layout: %s%s", self.cpu_plan.reason,
                    "".join(f"; engine {i}: cores {cpu_list(c)}"
                            for i, c in enumerate(self.cpu_plan.slots)))
        cmd = [sys.executable, "-m", "router.main", "--host", s.host, "--port", str(s.port),
               "--listen-fd", str(self._listener.fileno()),
               "--redis-url", self.redis_url, "--policy", s.policy,
               *self._passed_on("router"), *(["--kv-events"] if s.kv_events else []),
               *s.router_args]
        if s.otlp_traces_endpoint:
            cmd += ["--otlp-traces-endpoint", s.otlp_traces_endpoint]
        self._router_cmd = cmd
        self.router = self._start_router()
        if s.autoscale:
            self._autoscaler_cmd = [
                sys.executable, "-m", "serve.cli", "autoscale", "--redis-url", self.redis_url,
                "--router", self.url, "--max-prefill", str(s.prefill),
                "--max-decode", str(s.decode), *self._passed_on("autoscale"),
                *s.autoscale_args]
            self.autoscaler = self._popen("autoscaler", self._autoscaler_cmd,
                                          preexec_fn=child_setup())

    def _popen(self, name: str, cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start child ``name`` in its own session, its output in its log (``self.logs``)."""
        log = self.logs.open(name)
        try:
            return subprocess.Popen(cmd, start_new_session=True, env=self.env, stdout=log,
                                    stderr=None if log is None else subprocess.STDOUT, **kwargs)
        finally:
            if log is not None:
                log.close()  # the child holds its own copy

    def _passed_on(self, command: str) -> list[str]:
        """Flags of the shared settings ``command`` takes that ``pdserve up`` was given (by flag
        or env var); the ones every child command line already carries are left out."""
        explicit = {"redis_url", "policy", "kv_lease_s", "otlp_traces_endpoint"}
        return shared.to_flags(command, {name: value for name, value in self.settings.passed_on
                                         if name not in explicit})

    def spawn_worker(self, role: str, failures: int = 0) -> WorkerProc:
        """Start one worker of ``role`` (``failures``: crashes of the slot it replaces)."""
        s = self.settings
        assert self.model is not None
        port = free_port(s.host)
        cmd = [sys.executable, "-m", "serve.cli", "worker", "--role", role, "--model", self.model,
               "--served-model-name", self.served_name, "--redis-url", self.redis_url,
               "--port", str(port), "--host", s.host, "--kv-lease-s", str(s.lease_s),
               "--kv-cache-gib", str(s.kv_cache_gib), *self._passed_on("worker"),
               *s.worker_args]
        if s.otlp_traces_endpoint:
            cmd += ["--otlp-traces-endpoint", s.otlp_traces_endpoint]
        if s.kv_events and role in ("prefill", "aggregated", "flex"):
            cmd += self._kv_events_args(f"{role}-{port}")
        cpus = self._free_slot()
        proc = self._popen(f"{role}-{port}", cmd, preexec_fn=child_setup(cpus))
        worker = WorkerProc(role, f"http://{s.host}:{port}", proc, cpus=cpus, failures=failures)
        self.workers.append(worker)
        logger.info("started %s worker at %s on %s", role, worker.url,
                    f"cores {cpu_list(cpus)}" if cpus else "all cores")
        return worker

    def _free_slot(self) -> tuple[int, ...]:
        """Cores of the first engine slot no live worker holds (empty when floating)."""
        held = {w.cpus for w in self.workers if w.proc.poll() is None}
        return next((slot for slot in self.cpu_plan.slots if slot not in held), ())

    def _children(self) -> list[subprocess.Popen[bytes]]:
        return [p for _, _, p in self._named_children()]

    def _named_children(self) -> list[tuple[str, str, subprocess.Popen[bytes]]]:
        """(what to call it, its log's name, process) of every child."""
        named = [(f"{w.role} worker {w.url}", w.log_name, w.proc) for w in self.workers]
        return [(name, log, p) for name, log, p in [
            *named, ("router", "router", self.router),
            ("autoscaler", "autoscaler", self.autoscaler)] if p is not None]

    def _expected_workers(self) -> dict[str, int]:
        """``/health`` counts that mean every worker started is registered (an autoscaled pool
        starts with one)."""
        s = self.settings
        first = (lambda n: min(1, n)) if s.autoscale else (lambda n: n)
        return {"prefill_workers": first(s.prefill), "decode_workers": first(s.decode),
                "aggregated_workers": s.aggregated, "flex_workers": s.flex}

    async def wait_ready(self) -> None:
        """Wait until the router reports every worker it started registered (both pools
        live); :class:`StartupError` naming the child that died first, or the timeout."""
        expected = self._expected_workers()
        deadline = asyncio.get_running_loop().time() + self.settings.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while asyncio.get_running_loop().time() < deadline:
                dead = [c for c in self._named_children() if c[2].poll() is not None]
                if dead:
                    name, log, proc = dead[0]
                    raise StartupError(f"{name} exited during start-up "
                                       f"({exit_reason(proc.returncode)}); "
                                       + self._where_output(log))
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    resp = await client.get(f"{self.url}/health")
                    if resp.status_code == 200 and all(
                            resp.json().get(k, 0) >= n for k, n in expected.items()):
                        return
                await asyncio.sleep(0.5)
        raise StartupError(f"cluster not ready within {self.settings.ready_timeout_s:g} s")

    def _where_output(self, log: str, lines: int = 15) -> str:
        """Where child ``log``'s output is, for a message; prints the end of its log file
        first (the terminal shows nothing of it otherwise)."""
        path = self.logs.path(log)
        if path is None:
            return "its output is above"
        tail = self.logs.tail(log, lines)
        for line in tail:
            print(f"  {log}| {line}", file=sys.stderr)
        return f"{'the end of ' if tail else ''}its log {path}{' is above' if tail else ''}"

    def _log_hint(self, log: str) -> str:
        """`` (log PATH)`` for a message about child ``log``; empty without log files."""
        path = self.logs.path(log)
        return "" if path is None else f" (log {path})"

    def _start_router(self) -> subprocess.Popen[bytes]:
        """The router process, serving on the socket this supervisor keeps."""
        assert self._listener is not None
        return self._popen("router", self._router_cmd, preexec_fn=child_setup(),
                           pass_fds=(self._listener.fileno(),))

    def supervise(self) -> None:
        """Restart crashed children with backoff (``restart_delay_s``), logging why they
        exited. An autoscaled pool's crashed worker is only dropped: reconcile replaces it."""
        now = time.monotonic()
        if self.router is not None and self.router.poll() is not None:
            logger.error("router exited (%s)%s; restarting it",
                         exit_reason(self.router.returncode), self._log_hint("router"))
            self.router = self._start_router()
            self.restarts["router"] = self.restarts.get("router", 0) + 1
        if self.autoscaler is not None and self.autoscaler.poll() is not None:
            logger.error("autoscaler exited (%s)%s; restarting it",
                         exit_reason(self.autoscaler.returncode), self._log_hint("autoscaler"))
            self.autoscaler = self._popen("autoscaler", self._autoscaler_cmd,
                                          preexec_fn=child_setup())
            self.restarts["autoscaler"] = self.restarts.get("autoscaler", 0) + 1
        for w in [w for w in self.workers if w.proc.poll() is not None and not w.draining]:
            self.workers.remove(w)
            if self.settings.autoscale and w.role in ("prefill", "decode"):
                logger.error("%s worker %s %s%s; the autoscaler's reconcile replaces it",
                             w.role, w.url, exit_reason(w.proc.returncode),
                             self._log_hint(w.log_name))
                continue
            failures = 1 if now - w.started_at >= STABLE_S else w.failures + 1
            delay = restart_delay_s(failures)
            logger.error("%s worker %s %s after %.0f s%s; restarting in %.0f s (crash %d in a "
                         "row)", w.role, w.url, exit_reason(w.proc.returncode),
                         now - w.started_at, self._log_hint(w.log_name), delay, failures)
            self._pending.append(PendingRestart(w.role, now + delay, failures))
        for pending in [p for p in self._pending if p.due <= now]:
            self._pending.remove(pending)
            self.spawn_worker(pending.role, failures=pending.failures)
            self.restarts[pending.role] = self.restarts.get(pending.role, 0) + 1

    async def reconcile(self, registry: WorkerRegistry, desired: dict[str, int]) -> None:
        """Move each pool toward the autoscaler's desired size (one drain at a time per pool)."""
        live = {w.worker_id: w.http_url for w in await registry.list()}
        for role, maximum in (("prefill", self.settings.prefill),
                              ("decode", self.settings.decode)):
            if role not in desired:
                continue
            want = min(maximum, max(1, desired[role]))
            active = [w for w in self.workers if w.role == role and not w.draining]
            starting = [w for w in active if w.url not in live.values()]
            if len(active) < want:
                for _ in range(want - len(active)):
                    self.spawn_worker(role)
            elif len(active) > want and not starting and \
                    not any(w.role == role and w.draining for w in self.workers):
                victim = active[-1]
                worker_id = next(wid for wid, url in live.items() if url == victim.url)
                victim.draining = True
                task = asyncio.create_task(self.drain(registry, worker_id, victim))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)

    async def drain(self, registry: WorkerRegistry, worker_id: str, worker: WorkerProc) -> None:
        """No new work, wait until idle (no running or queued requests, no leased KV), stop."""
        logger.info("draining %s worker %s", worker.role, worker_id)
        await registry.mark_draining(worker_id)
        await asyncio.sleep(3.0)  # routers refresh membership every second
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout_s
        idle_checks = 0
        async with httpx.AsyncClient(timeout=5.0) as client:
            while idle_checks < 2 and asyncio.get_running_loop().time() < deadline:
                idle_checks = idle_checks + 1 if await _idle(client, worker.url) else 0
                await asyncio.sleep(1.0)
        await asyncio.to_thread(stop_process, worker.proc, 30.0)
        if worker in self.workers:
            self.workers.remove(worker)
        logger.info("drained and stopped %s worker %s", worker.role, worker_id)

    def stop(self) -> int:
        """Autoscaler and router first, then workers (they deregister), then our Redis; returns
        how many of these processes were still running."""
        running = sum(p.poll() is None for p in self._children()) + (
            self.redis is not None and self.redis.process.poll() is None)
        for proc in (self.autoscaler, self.router):
            if proc is not None:
                stop_process(proc, timeout_s=10)
        if self._listener is not None:  # no router left to take connections
            self._listener.close()
            self._listener = None
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            stop_process(w.proc, timeout_s=30)
        if self.redis is not None:
            self.redis.stop()
        for private in (self._secret_dir, self._events_dir):
            if private is not None:
                private.cleanup()
        return running


async def _idle(client: httpx.AsyncClient, url: str) -> bool:
    """True when the worker runs and queues nothing and holds no KV blocks (no leases).

    A worker that no longer answers scrapes as empty, hence idle (it is already gone).
    """
    from router.samples import total
    from router.state.worker_load import scrape

    samples = await scrape(client, url)
    return sum(total(samples, name) for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc")) == 0.0


def preflight(settings: ClusterSettings) -> None:
    """What can be checked before anything starts; :class:`StartupError` on the first problem."""
    passed_on = dict(settings.passed_on)
    check_policies(settings.policy, passed_on.get("decode_policy"))
    check_port_free(settings.host, settings.port)
    check_model(settings.model)


async def run_cluster(settings: ClusterSettings) -> int:
    """`pdserve up` in the foreground: start, print the URL when ready, stop on a signal.
    Raises :class:`StartupError` (after stopping whatever it started) when it cannot start."""
    preflight(settings)
    cluster = Cluster(settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    failed = False
    try:
        cluster.start()
        ready = asyncio.create_task(cluster.wait_ready())
        stop = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stop in done:
            ready.cancel()
            return 130
        stop.cancel()
        ready.result()
        pools = f"{settings.prefill} prefill + {settings.decode} decode"
        if settings.autoscale:
            pools = f"autoscaled up to {pools}"
        if settings.aggregated:
            pools = f"{settings.aggregated} aggregated" + (
                f" + {pools}" if settings.prefill else "")
        if settings.flex:
            pools = f"{settings.flex} flex (adaptive)" + (
                f" + {pools}" if settings.prefill or settings.aggregated else "")
        print(f"pdserve ready: {cluster.url}/v1 (model {cluster.served_name}, {pools}, "
              f"redis {redacted_url(cluster.redis_url)})", flush=True)
        if cluster.logs.directory is not None:
            print(f"pdserve logs: {cluster.logs.directory} (one file per process; Ctrl-C stops "
                  "the cluster)", flush=True)
        registry = WorkerRegistry(cluster.redis_url) if settings.autoscale else None
        desired = DesiredReplicas(cluster.redis_url) if settings.autoscale else None
        try:
            while not stopping.is_set():
                cluster.supervise()
                if registry is not None and desired is not None:
                    try:
                        await cluster.reconcile(registry, await desired.read())
                    except Exception:  # Redis hiccup: try again next second
                        logger.exception("reconcile failed")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=1.0)
            return 0
        finally:
            if registry is not None and desired is not None:
                await registry.close()
                await desired.close()
    except StartupError:
        failed = True
        raise
    finally:
        stopped = await asyncio.to_thread(cluster.stop)
        if not failed:  # after a failed start, the cause stays the last line
            # a line of its own: vLLM's engines end their exit dumps without a newline
            print(f"\npdserve stopped ({stopped} processes)", flush=True)


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve up` (each mirrors a PDSERVE_* env var). The settings it shares with
    the router, the workers and the autoscaler (``router.settings``) are passed on to them."""
    env = os.environ.get
    parser.add_argument("--model", default=env("PDSERVE_MODEL"),
                        help="model dir or HF id (default: the tiny offline model)")
    parser.add_argument("--served-model-name", default=env("PDSERVE_SERVED_MODEL_NAME"))
    parser.add_argument("--mode", choices=["pd", "aggregated", "adaptive"],
                        default=env("PDSERVE_MODE", "pd"),
                        help="pd: prefill + decode pools (default); aggregated: --replicas plain "
                             "vLLM workers behind the same router; adaptive: --replicas flex "
                             "workers, the router picks whole or P/D per request")
    parser.add_argument("--replicas", type=int, default=int(env("PDSERVE_REPLICAS", "1")),
                        help="workers of --mode aggregated or adaptive")
    parser.add_argument("--prefill", type=int, default=int(env("PDSERVE_PREFILL", "1")))
    parser.add_argument("--decode", type=int, default=int(env("PDSERVE_DECODE", "1")))
    parser.add_argument("--aggregated", type=int, default=int(env("PDSERVE_AGGREGATED", "0")),
                        help="plain vLLM workers beside the P/D pools (a mixed fleet)")
    parser.add_argument("--port", type=int, default=int(env("PDSERVE_PORT", "8000")))
    parser.add_argument("--host", default=env("PDSERVE_HOST", "127.0.0.1"))
    shared.add_arguments(parser, "up")
    parser.add_argument("--kv-cache-gib", type=float,
                        default=float(env("PDSERVE_WORKER_KV_CACHE_GIB", "1")))
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to every `pdserve worker` (repeatable)")
    parser.add_argument("--autoscale", action="store_true",
                        default=env("PDSERVE_AUTOSCALE", "") in ("1", "true"),
                        help="start 1 worker per pool; `pdserve autoscale` sizes the pools up to "
                             "--prefill/--decode")
    parser.add_argument("--cpu-layout", choices=["auto", "float"],
                        default=env("PDSERVE_CPU_LAYOUT", "auto"),
                        help="auto: each engine on its own cores when there are at least as many "
                             "cores as engines (default); float: every engine on every core")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to the router (repeatable), e.g. "
                             "--router-arg=--timeline-file=/tmp/t.jsonl")
    parser.add_argument("--kv-events", action="store_true",
                        default=env("PDSERVE_KV_EVENTS", "") in ("1", "true"),
                        help="prefill/aggregated workers publish their KV cache events and the "
                             "router learns their caches from them (default off)")
    parser.add_argument("--autoscale-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to `pdserve autoscale` (repeatable)")
    parser.add_argument("--log-dir", default=env("PDSERVE_LOG_DIR"), metavar="DIR",
                        help="where each child process (router, workers, autoscaler) writes "
                             "its output, one file each; '-' for the terminal (default: a new "
                             "directory under ~/.cache/pdserve/logs, or the terminal with "
                             "--log-level DEBUG)")


def settings_from_args(args: argparse.Namespace) -> ClusterSettings:
    """ClusterSettings from parsed `pdserve up` flags (shared settings resolved from the env)."""
    resolved = shared.resolve_into(args, "up")
    quiet = resolved["log_level"].value != "DEBUG"
    aggregated_only = args.mode == "aggregated"
    adaptive = args.mode == "adaptive"
    pools_only = aggregated_only or adaptive
    return ClusterSettings(model=args.model, served_model_name=args.served_model_name,
                           prefill=0 if pools_only else args.prefill,
                           decode=0 if pools_only else args.decode,
                           aggregated=args.replicas if aggregated_only else args.aggregated,
                           flex=args.replicas if adaptive else 0,
                           port=args.port,
                           host=args.host, redis_url=args.redis_url, policy=args.policy,
                           lease_s=args.kv_lease_s, kv_cache_gib=args.kv_cache_gib,
                           worker_args=tuple(args.worker_arg), autoscale=args.autoscale,
                           autoscale_args=tuple(args.autoscale_arg),
                           cpu_layout=args.cpu_layout, router_args=tuple(args.router_arg),
                           otlp_traces_endpoint=args.otlp_traces_endpoint,
                           kv_events=args.kv_events,
                           quiet_workers=quiet,
                           log_dir=_log_dir(args.log_dir, quiet),
                           passed_on=tuple((name, r.value) for name, r in resolved.items()
                                           if r.source != "default"))


def _log_dir(flag: str | None, quiet: bool) -> str | None:
    """``ClusterSettings.log_dir`` from ``--log-dir``: '-' is the terminal; unset is a new run
    directory for a quiet start and the terminal with ``--log-level DEBUG``."""
    if flag == "-":
        return None
    if flag:
        return flag
    return "auto" if quiet else None
