"""The router's view of cluster membership, refreshed from the registry in the background.

When Redis is unreachable the last membership is kept (and served from) until a refresh
succeeds again; workers that really died are then caught by upstream errors and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from router.errors import RegistryError
from router.state.registry import WorkerRecord, WorkerRegistry

logger = logging.getLogger(__name__)


class ClusterSource(Protocol):
    """What the API layer needs from a membership view."""

    @property
    def redis_ok(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]: ...

    def models(self) -> list[str]: ...


class ClusterView:
    """Membership read from a :class:`WorkerRegistry` every ``refresh_interval_s``."""

    def __init__(self, registry: WorkerRegistry, *, refresh_interval_s: float = 1.0,
                 own_registry: bool = True) -> None:
        self._registry = registry
        self._interval_s = refresh_interval_s
        self._own_registry = own_registry
        self._records: tuple[WorkerRecord, ...] = ()
        self._redis_ok = False
        self._task: asyncio.Task[None] | None = None

    @property
    def redis_ok(self) -> bool:
        """Whether the last refresh reached Redis."""
        return self._redis_ok

    async def refresh(self) -> bool:
        """Re-read membership once; on failure keep the previous one. Returns success."""
        try:
            records = await self._registry.list()
            draining = await self._registry.draining()
            records = [r for r in records if r.worker_id not in draining]
        except RegistryError as exc:
            if self._redis_ok:
                logger.warning("registry unreachable, keeping last membership (%d workers): %s",
                               len(self._records), exc)
            self._redis_ok = False
            return False
        if not self._redis_ok:
            logger.info("registry reachable, %d workers", len(records))
        self._apply(records)
        self._redis_ok = True
        return True

    def _apply(self, records: Sequence[WorkerRecord]) -> None:
        old = {r.worker_id for r in self._records}
        new = {r.worker_id for r in records}
        for wid in sorted(new - old):
            logger.info("worker joined: %s", wid)
        for wid in sorted(old - new):
            logger.info("worker left: %s", wid)
        self._records = tuple(records)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()

    async def start(self) -> None:
        if self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="pdserve-cluster-refresh")

    async def close(self) -> None:
        await cancel_task(self._task)
        self._task = None
        if self._own_registry:
            await self._registry.close()

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return _select(self._records, role, model)

    def models(self) -> list[str]:
        return sorted({r.model for r in self._records})


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background loop and wait until it has stopped (no-op for None)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class StaticCluster:
    """A fixed membership (tests, single-node setups without Redis)."""

    def __init__(self, records: Iterable[WorkerRecord]) -> None:
        self.records = tuple(sorted(records, key=lambda r: r.worker_id))

    @property
    def redis_ok(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return _select(self.records, role, model)

    def models(self) -> list[str]:
        return sorted({r.model for r in self.records})


def _select(
    records: Iterable[WorkerRecord], role: str | None, model: str | None
) -> list[WorkerRecord]:
    return [r for r in records
            if (role is None or r.role == role) and (model is None or r.model == model)]
