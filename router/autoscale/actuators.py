"""Actuators: make a pool the size the planner wants (I/O lives here, not in the planner).

- :class:`RedisActuator` writes the desired counts to Redis; the local `pdserve up` supervisor
  reconciles its worker processes against them, like a controller.
- The compose actuator (``router.autoscale.compose``) creates and removes service replicas
  through the Docker Engine API, draining each before it goes.
- The Kubernetes actuator (``router.autoscale.kubernetes``) patches the scale subresource.
"""

from __future__ import annotations

import logging
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
