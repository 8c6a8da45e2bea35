"""Faults the chaos runner injects into a running `pdserve up` cluster (the real processes).

Kinds (each with seeded random timing and victim):

- ``kill_prefill`` / ``kill_decode``: SIGKILL the vLLM server (its whole process group: API
  server and engine core) of one worker, while requests and pulls are in flight;
- ``sigterm_decode``: SIGTERM a decode launcher (it deregisters, then stops vLLM);
- ``restart_prefill``: SIGTERM a prefill launcher; the supervisor starts a new one (new engine
  id: decodes hold stale peers for the old one);
- ``sigstop_decode``: SIGSTOP a decode's vLLM past the lease, then SIGCONT;
- ``redis_outage``: stop Redis for ``redis_outage_s`` and start it again, empty, on its port;
- ``router_restart``: SIGTERM the router; the supervisor starts it again;
- ``client_abort_mid`` / ``client_abort_early`` / ``slow_readers``: the next clients hang up
  after three chunks, hang up before the first token, or read slowly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field

import psutil

from serve.chaos.load import ChaosLoad
from serve.redis_server import start_redis
from serve.supervisor import Cluster, WorkerProc

logger = logging.getLogger(__name__)

KINDS = ("kill_prefill", "kill_decode", "sigterm_decode", "restart_prefill", "sigstop_decode",
         "redis_outage", "router_restart", "client_abort_mid", "client_abort_early",
         "slow_readers")
POOL_OF = {"kill_prefill": "prefill", "restart_prefill": "prefill", "kill_decode": "decode",
           "sigterm_decode": "decode", "sigstop_decode": "decode", "redis_outage": "registry",
           "router_restart": "router"}
"""The pool whose recovery a fault is timed by (client faults: none)."""


@dataclass
class Injected:
    """One injected fault."""

    kind: str
    at: float
    """Unix time of the injection."""
    victim: str = ""
    recovered_s: float | None = None
    """Seconds from injection until the cluster was whole again (None: it never was)."""
    process: WorkerProc | None = field(default=None, repr=False)
    """The launcher that must exit before recovery can start (killed or stopped workers)."""


def vllm_group(worker: WorkerProc) -> int | None:
    """Process group of the worker's vLLM server (the launcher's child), if running."""
    try:
        children = psutil.Process(worker.proc.pid).children()
    except psutil.Error:
        return None
    for child in children:
        try:
            if any("vllm" in part for part in child.cmdline()):
                return os.getpgid(child.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return None


class FaultInjector:
    """Injects one fault at a time into ``cluster`` (whose processes this runner owns)."""

    def __init__(self, cluster: Cluster, load: ChaosLoad, rng: random.Random, *, lease_s: float,
                 redis_outage_s: float = 10.0, misbehaving_clients: int = 4) -> None:
        self.cluster = cluster
        self.load = load
        self.rng = rng
        self.lease_s = lease_s
        self.redis_outage_s = redis_outage_s
        self.misbehaving_clients = misbehaving_clients

    def _victim(self, role: str) -> WorkerProc | None:
        live = [w for w in self.cluster.workers
                if w.role == role and not w.draining and w.proc.poll() is None]
        return self.rng.choice(live) if live else None

    async def inject(self, kind: str) -> Injected:
        """Inject ``kind``; returns when the fault itself is over (not the recovery)."""
        fault = Injected(kind, time.time())
        if kind in ("kill_prefill", "kill_decode", "sigstop_decode"):
            role = "prefill" if kind == "kill_prefill" else "decode"
            worker = self._victim(role)
            group = vllm_group(worker) if worker is not None else None
            if worker is None or group is None:
                fault.victim = f"no running {role} vLLM"
                return fault
            fault.victim = worker.url
            if kind != "sigstop_decode":
                fault.process = worker
            if kind == "sigstop_decode":
                os.killpg(group, signal.SIGSTOP)
                try:
                    await asyncio.sleep(self.lease_s + 2.0)
                finally:
                    os.killpg(group, signal.SIGCONT)
            else:
                os.killpg(group, signal.SIGKILL)
        elif kind in ("sigterm_decode", "restart_prefill"):
            worker = self._victim("decode" if kind == "sigterm_decode" else "prefill")
            if worker is None:
                fault.victim = "no running worker"
                return fault
            fault.victim = worker.url
            fault.process = worker
            worker.proc.send_signal(signal.SIGTERM)
        elif kind == "redis_outage":
            redis = self.cluster.redis
            if redis is None:
                fault.victim = "redis not owned by this cluster"
                return fault
            fault.victim = redis.url
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(self.redis_outage_s)
            # on the loop's thread: a child dies with the thread that started it (PDEATHSIG)
            self.cluster.redis = start_redis(redis.port)
        elif kind == "router_restart":
            if self.cluster.router is not None:
                fault.victim = "router"
                self.cluster.router.send_signal(signal.SIGTERM)
        elif kind in ("client_abort_mid", "client_abort_early", "slow_readers"):
            behaviour = {"client_abort_mid": "abort_mid", "client_abort_early": "abort_early",
                         "slow_readers": "slow"}[kind]
            self.load.misbehave(behaviour, self.misbehaving_clients)
            fault.victim = f"{self.misbehaving_clients} clients"
        else:
            raise ValueError(f"unknown fault kind {kind!r}; allowed: {', '.join(KINDS)}")
        logger.info("fault %s injected (%s)", kind, fault.victim)
        return fault
