"""The router's view of cluster membership, refreshed from the registry in the background.

When Redis is unreachable the last membership is kept (and served from) until a refresh
succeeds again; workers that really died are then caught by upstream errors, evicted on the
first connection failure, and retried elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

import httpx

from router.errors import RegistryError
from router.state.registry import WorkerRecord, WorkerRegistry

logger = logging.getLogger(__name__)


JoinListener = Callable[[Sequence[WorkerRecord]], None]
"""Told which workers just joined (``ClusterSource.on_join``)."""


class ClusterSource(Protocol):
    """What the API layer needs from a membership view."""

    @property
    def redis_ok(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]: ...

    def models(self) -> list[str]: ...

    def evict(self, worker_id: str) -> None:
        """Stop routing to ``worker_id`` until it is known to answer again."""

    def leaving(self, worker_id: str) -> bool:
        """Whether ``worker_id`` asked to leave (draining or deregistered): its streams move."""

    def on_join(self, listener: JoinListener) -> None:
        """Call ``listener`` with the workers that joined, in the membership update that adds
        them (before any request can be placed on them)."""


Probe = Callable[[WorkerRecord], Awaitable[bool]]
"""Whether a worker answers now (its ``/health``)."""


class ClusterView:
    """Membership read from a :class:`WorkerRegistry` every ``refresh_interval_s``, corrected
    by what the workers themselves answer:

    - a worker whose registry key expired without a deregistration (a missed heartbeat: Redis
      slow or away) stays routable while its ``/health`` answers, up to ``orphan_grace_s``;
    - a worker the proxy could not connect to is evicted at once (:meth:`evict`) and taken
      back when its ``/health`` answers again or it registers anew (a new ``started_at``);
    - a deregistered (tombstoned) or draining worker leaves at once.
    """

    def __init__(self, registry: WorkerRegistry, *, refresh_interval_s: float = 1.0,
                 own_registry: bool = True, probe: Probe | None = None,
                 orphan_grace_s: float = 120.0, probe_timeout_s: float = 2.0) -> None:
        self._registry = registry
        self._interval_s = refresh_interval_s
        self._own_registry = own_registry
        self._probe = probe
        self._orphan_grace_s = orphan_grace_s
        self._probe_timeout_s = probe_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._records: tuple[WorkerRecord, ...] = ()
        self._evicted: dict[str, WorkerRecord] = {}
        self._orphans: dict[str, tuple[WorkerRecord, float]] = {}
        self._redis_ok = False
        self._leaving: frozenset[str] = frozenset()
        self._task: asyncio.Task[None] | None = None
        self._join_listeners: list[JoinListener] = []

    @property
    def redis_ok(self) -> bool:
        """Whether the last refresh reached Redis."""
        return self._redis_ok

    def evict(self, worker_id: str) -> None:
        """Take a worker out of routing now (a connection to it failed)."""
        record = next((r for r in self._records if r.worker_id == worker_id), None)
        if record is None:
            return
        self._evicted[worker_id] = record
        self._records = tuple(r for r in self._records if r.worker_id != worker_id)
        logger.warning("worker evicted after a connection failure: %s", worker_id)

    async def refresh(self) -> bool:
        """Re-read membership once; on failure keep the previous one. Returns success."""
        try:
            records = await self._registry.list()
            draining = await self._registry.draining()
            departed = await self._registry.departed()
        except RegistryError as exc:
            if self._redis_ok:
                logger.warning("registry unreachable, keeping last membership (%d workers): %s",
                               len(self._records), exc)
            self._redis_ok = False
            await self._readmit_answering()
            return False
        if not self._redis_ok:
            logger.info("registry reachable, %d workers", len(records))
        registered = {r.worker_id: r for r in records if r.worker_id not in draining}
        gone = draining | departed
        self._leaving = frozenset(gone)
        for wid, rec in list(self._evicted.items()):
            now_rec = registered.get(wid)
            if wid in gone or now_rec is None or now_rec.started_at != rec.started_at:
                del self._evicted[wid]  # left, or registered anew: the registry decides again
        now = time.monotonic()
        for rec in self._records:
            if rec.worker_id not in registered and rec.worker_id not in gone and \
                    rec.worker_id not in self._orphans:
                self._orphans[rec.worker_id] = (rec, now)
                logger.warning("registry key of worker %s expired; kept while it answers",
                               rec.worker_id)
        for wid, (_, since) in list(self._orphans.items()):
            if wid in registered or wid in gone:
                del self._orphans[wid]
            elif now - since > self._orphan_grace_s:
                del self._orphans[wid]
                logger.warning("worker %s answered but did not re-register within %.0f s",
                               wid, self._orphan_grace_s)
        alive = await self._probe_all([*(registered[w] for w in self._evicted),
                                       *(rec for rec, _ in self._orphans.values())])
        for wid in [w for w in self._evicted if alive.get(w)]:
            del self._evicted[wid]
            logger.info("evicted worker %s answers again", wid)
        for wid in [w for w in self._orphans if not alive.get(w)]:
            del self._orphans[wid]
        members = [r for r in registered.values() if r.worker_id not in self._evicted]
        members += [rec for rec, _ in self._orphans.values()]
        self._apply(sorted(members, key=lambda r: r.worker_id))
        self._redis_ok = True
        return True

    async def _readmit_answering(self) -> None:
        """Registry away: evicted workers that answer again come back to the last view."""
        alive = await self._probe_all(list(self._evicted.values()))
        back = [self._evicted.pop(wid) for wid in [w for w in self._evicted if alive.get(w)]]
        if back:
            self._apply(sorted([*self._records, *back], key=lambda r: r.worker_id))

    async def _probe_all(self, records: Sequence[WorkerRecord]) -> dict[str, bool]:
        if not records:
            return {}
        results = await asyncio.gather(*(self._answers(r) for r in records))
        return {r.worker_id: ok for r, ok in zip(records, results, strict=True)}

    async def _answers(self, record: WorkerRecord) -> bool:
        if self._probe is not None:
            return await self._probe(record)
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)
        try:
            resp = await self._client.get(record.http_url + "/health",
                                          timeout=self._probe_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _apply(self, records: Sequence[WorkerRecord]) -> None:
        old = {r.worker_id for r in self._records}
        new = {r.worker_id for r in records}
        for wid in sorted(new - old):
            logger.info("worker joined: %s", wid)
        for wid in sorted(old - new):
            logger.info("worker left: %s", wid)
        self._records = tuple(records)
        joined = [r for r in records if r.worker_id not in old]
        for listener in self._join_listeners if joined else ():
            try:  # synchronous: no request is placed between the update and the listener
                listener(joined)
            except Exception:  # a listener's failure must not stop membership updates
                logger.exception("join listener failed")

    def on_join(self, listener: JoinListener) -> None:
        self._join_listeners.append(listener)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:  # a probe or log failure must not end membership updates
                logger.exception("membership refresh failed")

    async def start(self) -> None:
        if self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="pdserve-cluster-refresh")

    async def close(self) -> None:
        await cancel_task(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
        if self._own_registry:
            await self._registry.close()

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return _select(self._records, role, model)

    def leaving(self, worker_id: str) -> bool:
        return worker_id in self._leaving

    def models(self) -> list[str]:
        return sorted({r.model for r in self._records})


CANCEL_RETRY_S = 0.1


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background loop and wait until it has stopped (no-op for None).

    The cancellation is repeated every :data:`CANCEL_RETRY_S` until the task ends: one can be
    lost inside a library (Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives
    as its inner future completes, and redis-py's reads use it), and a loop that lost it would
    run on while this waited forever: the router's shutdown hung that way."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_RETRY_S)
    if not task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.result()  # a loop that ended with an error: re-raise it here


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

    def evict(self, worker_id: str) -> None:
        return None  # a fixed membership has nothing to re-check

    def leaving(self, worker_id: str) -> bool:
        return False  # nobody leaves a fixed membership

    def on_join(self, listener: JoinListener) -> None:
        return None  # nobody joins a fixed membership either

    def models(self) -> list[str]:
        return sorted({r.model for r in self.records})


def _select(
    records: Iterable[WorkerRecord], role: str | None, model: str | None
) -> list[WorkerRecord]:
    return [r for r in records
            if (role is None or r.role == role) and (model is None or r.model == model)]
