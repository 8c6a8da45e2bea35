"""Actuators: make a pool the size the planner wants (I/O lives here, not in the planner).

- :class:`RedisActuator` writes the desired counts to Redis; the local `pdserve up` supervisor
  reconciles its worker processes against them, like a controller.
- :class:`ComposeActuator` runs ``docker compose up -d --no-recreate --scale ...``.
- The Kubernetes actuator (``router.autoscale.kubernetes``) patches the scale subresource.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from typing import Protocol

import redis.asyncio as aioredis

from router.autoscale.planner import Decision

logger = logging.getLogger(__name__)


class Actuator(Protocol):
    """Applies one interval's decisions."""

    async def apply(self, decisions: Sequence[Decision], now_s: float) -> None: ...


def desired_key(prefix: str) -> str:
    """Redis hash holding the desired replicas per pool."""
    return f"{prefix}:autoscaler:desired"


def decisions_key(prefix: str) -> str:
    """Redis list of recent decisions (newest first)."""
    return f"{prefix}:autoscaler:decisions"


class RedisActuator:
    """Publishes desired replicas in Redis (the decisions themselves go to
    ``router.autoscale.decisions.DecisionLog``, whatever the actuator)."""

    def __init__(self, redis_url: str, prefix: str = "pdserve") -> None:
        self._redis = aioredis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
        self._prefix = prefix

    async def apply(self, decisions: Sequence[Decision], now_s: float) -> None:
        mapping: dict[str | bytes, int] = {d.pool: d.desired for d in decisions}
        await self._redis.hset(desired_key(self._prefix), mapping=mapping)  # type: ignore[misc,arg-type]

    async def close(self) -> None:
        await self._redis.aclose()


class DesiredReplicas:
    """Reads what :class:`RedisActuator` wrote (the local supervisor's side)."""

    def __init__(self, redis_url: str, prefix: str = "pdserve") -> None:
        self._redis = aioredis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
        self._prefix = prefix

    async def read(self) -> dict[str, int]:
        """pool -> desired replicas (empty until the autoscaler decided once)."""
        raw = await self._redis.hgetall(desired_key(self._prefix))  # type: ignore[misc]
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._redis.aclose()


class ComposeActuator:
    """Scales the compose services with ``docker compose --scale`` (or docker-compose 1.x)."""

    def __init__(self, compose_file: str, services: dict[str, str] | None = None) -> None:
        self.compose_file = compose_file
        self.services = services or {"prefill": "prefill", "decode": "decode"}
        self.base = (["docker", "compose"] if shutil.which("docker") else ["docker-compose"])

    def command(self, decisions: Sequence[Decision]) -> list[str]:
        """The exact command for these decisions."""
        cmd = [*self.base, "-f", self.compose_file, "up", "-d", "--no-recreate"]
        for d in decisions:
            cmd += ["--scale", f"{self.services[d.pool]}={d.desired}"]
        return cmd + [self.services[d.pool] for d in decisions]

    async def apply(self, decisions: Sequence[Decision], now_s: float) -> None:
        if all(d.desired == d.current for d in decisions):
            return
        cmd = self.command(decisions)
        logger.info("scaling: %s", " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            logger.error("compose scale failed (%d): %s", done.returncode, done.stderr[-2000:])
