"""`pdserve autoscale`: scrape, plan, act, every interval (the I/O shell around the planner).

Several replicas may run; a Redis lock (redis-py's ``Lock``: ``SET NX PX`` to take it, a Lua
script that checks the owner token to extend it) lets exactly one act at a time. Each
interval it scrapes the router and every registered worker, turns two snapshots into an
:class:`Observation`, asks the :class:`Planner`, and makes every decision visible three ways:
metrics (``pdserve_autoscaler_{desired,current,ready}_replicas{pool}``,
``pdserve_autoscaler_decisions_total{pool,direction,reason}``,
``pdserve_autoscaler_load{pool,kind}``, ``pdserve_autoscaler_headroom_ratio{pool}``), a log
line, and a record in Redis (``router.autoscale.decisions``, read by ``pdserve autoscale
status``); then it hands them to the actuator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from router import settings as shared
from router.autoscale.actuators import Actuator, RedisActuator
from router.autoscale.capacity import capacity_models
from router.autoscale.decisions import DecisionLog
from router.autoscale.planner import Decision, Planner, PlannerConfig
from router.autoscale.profile import InstanceProfile
from router.autoscale.signals import Snapshot, observe
from router.samples import Samples
from router.state.registry import WorkerRegistry
from router.state.worker_load import scrape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscalerSettings:
    """Settings of one autoscaler process."""

    redis_url: str
    router_url: str
    interval_s: float = 10.0
    profile: str | None = None
    actuator: str = "redis"
    compose_project: str = ""
    drain_timeout_s: float = 150.0
    metrics_port: int = 0
    prefix: str = "pdserve"
    namespace: str = "pdserve"
    prefill_deployment: str = "pdserve-prefill"
    decode_deployment: str = "pdserve-decode"
    planner: PlannerConfig = PlannerConfig()


def leader_lock(redis: aioredis.Redis, key: str, interval_s: float) -> Lock:
    """The leader lock of the autoscalers sharing ``key``: held for three intervals unless
    extended, so a dead leader is replaced within that time."""
    return Lock(redis, key, timeout=3 * interval_s, blocking=False, thread_local=False)


async def hold_leadership(lock: Lock) -> bool:
    """Take or keep ``lock``; True while this process is the leader. Extending is atomic (the
    owner token is checked in the same script that resets the TTL), so two autoscalers never
    both believe they lead."""
    if lock.local.token is not None:
        try:
            await lock.reacquire()
            return True
        except LockError:  # expired and maybe taken by another: try again below
            lock.local.token = None
    return bool(await lock.acquire())


class Autoscaler:
    """The loop; ``run`` returns when ``stop`` is set."""

    def __init__(self, settings: AutoscalerSettings, actuator: Actuator) -> None:
        self.settings = settings
        prefill, decode = capacity_models(InstanceProfile.load(settings.profile)
                                          if settings.profile else InstanceProfile())
        self.planner = Planner(settings.planner, prefill, decode)
        self.actuator = actuator
        self.registry = WorkerRegistry(settings.redis_url, prefix=settings.prefix)
        self._redis = aioredis.from_url(settings.redis_url, socket_connect_timeout=1.0,
                                        socket_timeout=2.0)
        self._lock = leader_lock(self._redis, f"{settings.prefix}:autoscaler:lock",
                                 settings.interval_s)
        self._desired: dict[str, int] = {}
        self.stop = asyncio.Event()
        self.metrics = CollectorRegistry()
        self.desired = Gauge("pdserve_autoscaler_desired_replicas", "Replicas the planner wants.",
                             ["pool"], registry=self.metrics)
        self.decisions = Counter("pdserve_autoscaler_decisions_total",
                                 "Planner decisions by pool, direction and reason.",
                                 ["pool", "direction", "reason"], registry=self.metrics)
        self.current = Gauge("pdserve_autoscaler_current_replicas",
                             "Replicas of the pool when the planner decided (serving + starting).",
                             ["pool"], registry=self.metrics)
        self.ready = Gauge("pdserve_autoscaler_ready_replicas",
                           "Registered, serving replicas of the pool the planner observed.",
                           ["pool"], registry=self.metrics)
        self.load = Gauge("pdserve_autoscaler_load",
                          "Pool load (prefill: uncached tokens/s; decode: output tokens/s): "
                          "observed in the interval, predicted (forecast), planned (sized for).",
                          ["pool", "kind"], registry=self.metrics)
        self.headroom = Gauge("pdserve_autoscaler_headroom_ratio",
                              "Burst headroom factor applied to the forecast.", ["pool"],
                              registry=self.metrics)
        self.decision_log = DecisionLog(settings.redis_url, settings.prefix)

    async def _leader(self) -> bool:
        return await hold_leadership(self._lock)

    async def snapshot(self, client: httpx.AsyncClient) -> Snapshot:
        """Scrape the router and every routable worker."""
        workers = await self.registry.list()
        draining = await self.registry.draining()
        live = [w for w in workers if w.worker_id not in draining]
        router = await scrape(client, self.settings.router_url)
        pools: dict[str, dict[str, Samples]] = {"prefill": {}, "decode": {}}
        for w in live:
            pools[w.role][w.worker_id] = await scrape(client, w.http_url)
        return Snapshot(time.monotonic(), router, pools["prefill"], pools["decode"])

    async def run(self) -> None:
        previous: Snapshot | None = None
        async with httpx.AsyncClient(timeout=5.0) as client:
            while not self.stop.is_set():
                try:
                    if await self._leader():
                        current = await self.snapshot(client)
                        if previous is not None and current.prefill and current.decode:
                            await self.step(previous, current)
                        previous = current
                    else:
                        previous = None
                except Exception:  # keep the loop alive through Redis/worker hiccups
                    logger.exception("autoscaler interval failed")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=self.settings.interval_s)
        await self.registry.close()
        await self.decision_log.close()
        await self._redis.aclose()

    async def step(self, previous: Snapshot, current: Snapshot) -> None:
        """One planning interval."""
        obs = observe(previous, current)
        # Workers still starting count as present: otherwise a quiet interval during their start
        # reads as "steady at the old size" and cancels the scale-up just before they join.
        want_p, want_d = self._desired.get("prefill", 0), self._desired.get("decode", 0)
        obs = dataclasses.replace(
            obs,
            prefill_replicas=max(obs.prefill_replicas, want_p),
            decode_replicas=max(obs.decode_replicas, want_d),
            prefill_starting=max(0, want_p - obs.prefill_replicas),
            decode_starting=max(0, want_d - obs.decode_replicas))
        decisions = self.planner.plan(obs)
        self._desired = {d.pool: d.desired for d in decisions}
        starting = {"prefill": obs.prefill_starting, "decode": obs.decode_starting}
        for d in decisions:
            self.export(d, d.current - starting[d.pool])
        try:
            await self.decision_log.record(decisions, time.time())
        except Exception as exc:  # the decision stands; losing its record must not stop it
            logger.warning("cannot record decisions in Redis: %s", exc)
        await self.actuator.apply(decisions, obs.now_s)

    def export(self, d: Decision, ready: int) -> None:
        """One decision as metrics and a log line."""
        self.desired.labels(pool=d.pool).set(d.desired)
        self.current.labels(pool=d.pool).set(d.current)
        self.ready.labels(pool=d.pool).set(ready)
        self.decisions.labels(pool=d.pool, direction=d.direction, reason=d.reason).inc()
        for kind, value in (("observed", d.observed_load), ("predicted", d.predicted_load),
                            ("planned", d.load)):
            self.load.labels(pool=d.pool, kind=kind).set(value)
        self.headroom.labels(pool=d.pool).set(d.headroom)
        logger.info("decision %s: %d -> %d (%s); load observed %.1f, predicted %.1f, headroom "
                    "%.2f, sized for %.1f; capacity/instance %.1f", d.pool, d.current,
                    d.desired, d.reason, d.observed_load, d.predicted_load, d.headroom, d.load,
                    d.capacity_per_instance)


def add_autoscale_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve autoscale`: each of its own reads PDSERVE_AUTOSCALE_<FLAG> (the pool
    ceilings also their older PDSERVE_MAX_PREFILL / PDSERVE_MAX_DECODE); the SLOs, Redis and log
    level are the shared settings of ``router.settings``. Every help line names its env var and
    default."""
    shared.add_arguments(parser, "autoscale")

    def flag(name: str, default: Any, help: str, *, type: Callable[[str], Any] = str,
             legacy_env: str | None = None, aliases: tuple[str, ...] = (), **kw: Any) -> None:
        env_name = "PDSERVE_AUTOSCALE_" + name.lstrip("-").replace("-", "_").upper()
        raw = os.environ.get(env_name)
        if raw is None and legacy_env is not None:
            raw = os.environ.get(legacy_env)
        envs = env_name + (f" or {legacy_env}" if legacy_env else "")
        shown = "unset" if default in (None, "") else default
        parser.add_argument(name, *aliases, type=type,
                            default=default if raw is None else type(raw),
                            help=f"{help} ({envs}; default {shown})", **kw)

    flag("--router", "http://127.0.0.1:8000", "router whose metrics give the load",
         metavar="URL", aliases=("--router-url",))
    flag("--interval-s", 10.0, "seconds between two planning steps", type=float, metavar="S")
    flag("--profile", None, "profile JSON from `pdserve bench profile`", metavar="FILE")
    flag("--min-replicas", 1, "never fewer workers per pool", type=int, metavar="N")
    flag("--max-prefill", 4, "most prefill workers", type=int, metavar="N",
         legacy_env="PDSERVE_MAX_PREFILL")
    flag("--max-decode", 4, "most decode workers", type=int, metavar="N",
         legacy_env="PDSERVE_MAX_DECODE")
    flag("--cooldown-s", 60.0, "scale down only to the largest size asked for within this long",
         type=float, metavar="S")
    flag("--predictor", "holt", "arrival-rate predictor", choices=["last", "ewma", "holt"])
    flag("--burst-quantile", 0.9, "size for this quantile of the rate's overshoots over a start "
         "time (0: no burst headroom)", type=float, metavar="Q")
    flag("--burst-window-s", 900.0, "history the burst headroom is learned from", type=float,
         metavar="S")
    flag("--correction-alpha", 0.3, "EWMA weight of the online model fits (0: the profile as is)",
         type=float, metavar="A")
    flag("--actuator", "redis", "who applies the decisions (redis: an autoscaled `pdserve up` "
         "reads them)", choices=["redis", "compose", "kubernetes"])
    flag("--compose-project", "", "compose project the compose actuator scales (unset: the "
         "autoscaler container's own, else $COMPOSE_PROJECT_NAME)", metavar="NAME")
    flag("--drain-timeout-s", 150.0, "compose actuator: stop a replica being removed after this "
         "long even if it is not idle", type=float, metavar="S")
    flag("--namespace", "pdserve", "kubernetes actuator: namespace of the deployments")
    flag("--prefill-deployment", "pdserve-prefill", "kubernetes actuator: the prefill "
         "Deployment", metavar="NAME")
    flag("--decode-deployment", "pdserve-decode", "kubernetes actuator: the decode Deployment",
         metavar="NAME")
    flag("--metrics-port", 0, "serve the autoscaler's own /metrics here (0: off)", type=int,
         metavar="PORT")


def settings_from_args(args: argparse.Namespace) -> AutoscalerSettings:
    """AutoscalerSettings from parsed flags (shared settings resolved from the env here)."""
    shared.resolve_into(args, "autoscale")
    planner = PlannerConfig(ttft_slo_s=args.ttft_slo_s, tpot_slo_s=args.tpot_slo_s,
                            min_replicas=args.min_replicas,
                            max_replicas=max(args.max_prefill, args.max_decode),
                            max_prefill_replicas=args.max_prefill,
                            max_decode_replicas=args.max_decode,
                            scale_down_cooldown_s=args.cooldown_s, predictor=args.predictor,
                            burst_quantile=args.burst_quantile,
                            burst_window_s=args.burst_window_s,
                            correction_alpha=args.correction_alpha)
    return AutoscalerSettings(redis_url=args.redis_url, router_url=args.router,
                              interval_s=args.interval_s, profile=args.profile,
                              actuator=args.actuator, compose_project=args.compose_project,
                              drain_timeout_s=args.drain_timeout_s,
                              metrics_port=args.metrics_port, planner=planner,
                              namespace=args.namespace,
                              prefill_deployment=args.prefill_deployment,
                              decode_deployment=args.decode_deployment)


class _ThreadedActuator:
    """Runs a blocking actuator's ``apply(decisions)`` off the event loop."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def apply(self, decisions: Sequence[Decision], now_s: float) -> None:
        await asyncio.to_thread(self._inner.apply, decisions)


async def run_autoscaler(settings: AutoscalerSettings) -> int:
    """Run until SIGTERM/SIGINT."""
    actuator: Actuator
    if settings.actuator == "compose":
        from router.autoscale.compose import ComposeActuatorConfig, DockerComposeActuator

        actuator = DockerComposeActuator(ComposeActuatorConfig(
            redis_url=settings.redis_url, prefix=settings.prefix,
            project=settings.compose_project, drain_timeout_s=settings.drain_timeout_s))
    elif settings.actuator == "kubernetes":
        from router.autoscale.kubernetes import KubernetesActuator, KubernetesActuatorConfig

        actuator = _ThreadedActuator(KubernetesActuator(KubernetesActuatorConfig(
            namespace=settings.namespace, prefill_deployment=settings.prefill_deployment,
            decode_deployment=settings.decode_deployment)))
    else:
        actuator = RedisActuator(settings.redis_url, settings.prefix)
    scaler = Autoscaler(settings, actuator)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=scaler.metrics)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, scaler.stop.set)
    logger.info("autoscaler started (interval %.1f s, actuator %s)", settings.interval_s,
                settings.actuator)
    await scaler.run()
    if isinstance(actuator, RedisActuator):
        await actuator.close()
    return 0
