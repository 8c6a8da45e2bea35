"""The compose actuator: resizes the ``prefill``/``decode`` services through the Docker Engine
API (the ``docker`` SDK over the socket compose mounts into the autoscaler).

Each interval it reconciles every pool with the planner's desired count, as a controller
(a failed create is retried on the next interval):

- scale up: a new replica cloned from an existing one, the way compose makes it (same config,
  the compose labels with the next container number, the compose name, the project network
  with the service alias); ``compose_plan`` decides what to create;
- scale down: the replicas compose would remove (highest numbers), each drained first with the
  Kubernetes preStop's steps (``router.autoscale.drain``): its workers go into the registry's
  draining set (routers send them nothing new), then the actuator waits until the worker runs,
  queues and holds nothing (or ``drain_timeout_s``); only then it stops the container (the
  worker deregisters on SIGTERM) and removes it.

Docker calls block: they run in a thread, the drain's waits on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.autoscale import compose_plan as cp
from router.autoscale.drain import DrainConfig, deregister_from_routing, wait_idle
from router.autoscale.planner import Decision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComposeActuatorConfig:
    """Which compose project and services to scale, and how to drain a replica."""

    redis_url: str
    prefix: str = "pdserve"
    project: str = ""
    """Compose project; empty: this container's own project label, else $COMPOSE_PROJECT_NAME."""
    services: dict[str, str] = field(
        default_factory=lambda: {"prefill": "prefill", "decode": "decode"})
    """Pool -> compose service."""
    worker_port: int = 8100
    """The workers' HTTP port inside their containers (the drain watches its /metrics)."""
    drain_timeout_s: float = 150.0
    """Stop a replica after this long even if it is not idle yet."""
    stop_timeout_s: int = 30
    """SIGTERM to SIGKILL when the container sets no StopTimeout of its own."""


def own_project(client: Any) -> str:
    """The compose project of the container this process runs in, else $COMPOSE_PROJECT_NAME."""
    try:
        me = client.api.inspect_container(socket.gethostname())
        project = (me["Config"].get("Labels") or {}).get(cp.PROJECT, "")
    except Exception:  # not in a container, or not one compose made
        project = ""
    project = project or os.environ.get("COMPOSE_PROJECT_NAME", "")
    if not project:
        raise RuntimeError("compose project unknown: set --compose-project")
    return str(project)


class DockerComposeActuator:
    """Reconciles the compose services with the planner's decisions."""

    def __init__(self, config: ComposeActuatorConfig, client: Any = None) -> None:
        if client is None:
            import docker

            client = docker.from_env()
        self.config = config
        self.client = client
        self.project = config.project or own_project(client)

    def replicas(self, service: str) -> tuple[list[cp.Replica], list[dict[str, Any]]]:
        """The service's replicas and their inspections."""
        labels = [f"{cp.PROJECT}={self.project}", f"{cp.SERVICE}={service}"]
        found = self.client.api.containers(all=True, filters={"label": labels})
        inspected = [self.client.api.inspect_container(c["Id"]) for c in found]
        return cp.replicas_from(inspected, self.project, service), inspected

    async def apply(self, decisions: Sequence[Decision], now_s: float) -> None:
        for d in decisions:
            await self.scale(self.config.services[d.pool], d.desired)

    async def scale(self, service: str, desired: int) -> cp.ScalePlan:
        """Make ``service`` run ``max(desired, 1)`` replicas; returns what was done."""
        replicas, inspected = await asyncio.to_thread(self.replicas, service)
        plan = cp.plan_scale(self.project, service, replicas, desired)
        if plan.create:
            by_id = {i["Id"]: i for i in inspected}
            template = next((by_id[r.id] for r in replicas if r.running), None)
            if template is None:
                raise RuntimeError(f"no running {service} replica to clone")
            for number, name in plan.create:
                await asyncio.to_thread(self.create, template, service, number, name)
        for replica in plan.remove:
            ids = await self.drain(replica)
            await asyncio.to_thread(self.remove, replica)
            await self.forget(ids)
        return plan

    def create(self, template: dict[str, Any], service: str, number: int, name: str) -> str:
        """Create and start replica ``number`` from ``template``; returns its id."""
        created = self.client.api.create_container_from_config(
            cp.clone_config(template, service, number, name), name=name)
        cid = str(created["Id"])
        for net in cp.other_networks(template):
            self.client.api.connect_container_to_network(
                cid, net, aliases=cp.aliases(service, name)["Aliases"])
        self.client.api.start(cid)
        logger.info("scale up: started %s (%s)", name, cid[:12])
        return cid

    async def drain(self, replica: cp.Replica) -> list[str]:
        """Take the replica's workers out of routing, then wait until idle; returns their ids."""
        info = await asyncio.to_thread(self.client.api.inspect_container, replica.id)
        networks = info.get("NetworkSettings", {}).get("Networks") or {}
        ip = next((n["IPAddress"] for n in networks.values() if n.get("IPAddress")), "")
        config = DrainConfig(worker_url=f"http://{ip}:{self.config.worker_port}",
                             redis_url=self.config.redis_url, prefix=self.config.prefix,
                             hostname=info["Config"]["Hostname"],
                             timeout_s=self.config.drain_timeout_s)
        ids = await deregister_from_routing(config)
        logger.info("scale down: %s out of routing (%s), draining", replica.name,
                    ", ".join(ids) or "no registered worker")
        idle = await wait_idle(config) if ip else True
        logger.info("scale down: %s %s", replica.name,
                    "idle" if idle else f"not idle after {config.timeout_s:.0f} s")
        return ids

    def remove(self, replica: cp.Replica) -> None:
        """Stop (SIGTERM, then SIGKILL after the stop timeout) and remove the container."""
        info = self.client.api.inspect_container(replica.id)
        timeout = info["Config"].get("StopTimeout") or self.config.stop_timeout_s
        self.client.api.stop(replica.id, timeout=timeout)
        self.client.api.remove_container(replica.id)
        logger.info("scale down: removed %s", replica.name)

    async def forget(self, worker_ids: list[str]) -> None:
        """Deregister the removed workers (a worker killed before its own deregistration would
        otherwise stay in the draining set)."""
        from router.state.registry import WorkerRegistry

        registry = WorkerRegistry(self.config.redis_url, prefix=self.config.prefix)
        try:
            for worker_id in worker_ids:
                await registry.deregister(worker_id)
        finally:
            await registry.close()
