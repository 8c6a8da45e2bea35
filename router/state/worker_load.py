"""Workers' own load, scraped from their ``/metrics`` in the background.

The router's in-flight accounting sees only what this router replica dispatched. vLLM's gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``)
see everything a worker holds, whichever router (or client) sent it. :class:`WorkerLoadPoller`
keeps the latest of those per worker; :meth:`router.state.load.LoadTracker.candidates` merges
them into the snapshots the placement policies score.

A worker whose scrape fails or is older than ``stale_after`` intervals reports nothing, and is
scored on the router's own accounting alone. A worker is *unresponsive* (requests waiting on it
move elsewhere) once nothing listens on its port, or once its probes have gone unanswered for
``silent_after_s``: one slow answer from a busy worker is not a stopped one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import httpx

from router.samples import Samples, has, parse_samples, total
from router.state.cluster import ClusterSource, cancel_task
from router.state.registry import WorkerRecord

logger = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
LOAD_SAMPLES = (RUNNING, WAITING, KV_USAGE)


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load as it reported it."""

    running: int
    """Requests the engine is running (``vllm:num_requests_running``)."""
    waiting: int
    """Requests queued in the engine (``vllm:num_requests_waiting``)."""
    kv_usage: float
    """Fraction of its KV cache in use (``vllm:kv_cache_usage_perc``), in [0, 1]."""
    own_in_flight: int = 0
    """This router's in-flight requests on the worker when the scrape answered: the rest of
    ``running + waiting`` was sent by someone else."""
    scraped_at_s: float = 0.0
    """Monotonic time of the scrape."""


def worker_load(samples: Samples, own_in_flight: int = 0, at_s: float = 0.0
                ) -> WorkerLoad | None:
    """The load in ``samples``; None when they lack vLLM's gauges (not a vLLM worker)."""
    if not all(has(samples, name) for name in LOAD_SAMPLES):
        return None
    # summed over engines (data-parallel ranks label theirs); usage is the busiest engine's
    usage = max((v for (n, _), v in samples.items() if n == KV_USAGE), default=0.0)
    return WorkerLoad(running=round(total(samples, RUNNING)),
                      waiting=round(total(samples, WAITING)),
                      kv_usage=min(max(usage, 0.0), 1.0), own_in_flight=own_in_flight,
                      scraped_at_s=at_s)


@dataclass(frozen=True)
class ProbeSilence:
    """Since when a worker has left the router's load probes unanswered."""

    since_s: float
    """Monotonic time the first unanswered probe was sent."""
    refused: bool
    """The latest probe found nothing listening (the process is gone, not slow)."""

    def unresponsive(self, now_s: float, silent_after_s: float) -> bool:
        """Whether the worker counts as stopped: refused, or silent for ``silent_after_s``."""
        return self.refused or now_s - self.since_s >= silent_after_s


async def fetch_samples(client: httpx.AsyncClient, url: str, timeout_s: float,
                        names: Collection[str] | None = None) -> Samples:
    """Samples of ``url``/metrics (only those named in ``names``, when given); raises
    httpx.HTTPError or ValueError."""
    resp = await client.get(f"{url}/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return parse_samples(resp.text, names)


async def scrape(client: httpx.AsyncClient, url: str, timeout_s: float = 5.0) -> Samples:
    """Samples of ``url``/metrics, empty on failure (the source is skipped this time)."""
    try:
        return await fetch_samples(client, url, timeout_s)
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("cannot scrape %s: %s", url, exc)
        return {}


class WorkerLoadPoller:
    """Scrapes every registered worker each ``interval_s``; :meth:`loads` has the fresh ones."""

    def __init__(self, cluster: ClusterSource, client: Callable[[], httpx.AsyncClient | None],
                 own_in_flight: Callable[[str], int], *, interval_s: float = 1.0,
                 stale_after: float = 3.0, silent_after_s: float = 3.0,
                 on_failure: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cluster = cluster
        self._client = client
        self._own_in_flight = own_in_flight
        self._on_failure = on_failure
        self._interval_s = interval_s
        # at least a second for an answer (and thrice that before a report goes stale), however
        # short the interval: a busy worker is slow to answer, not unloaded
        self._timeout_s = max(interval_s, 1.0)
        self._max_age_s = stale_after * self._timeout_s
        # never less than one probe's timeout: a single unanswered probe is not a stopped worker
        self._silent_after_s = max(silent_after_s, self._timeout_s)
        self._clock = clock
        self._loads: dict[str, WorkerLoad] = {}
        self._failing: dict[str, ProbeSilence] = {}
        self._task: asyncio.Task[None] | None = None

    def loads(self) -> dict[str, WorkerLoad]:
        """worker id -> its latest load, for workers scraped within the staleness bound."""
        now = self._clock()
        return {wid: load for wid, load in self._loads.items()
                if now - load.scraped_at_s <= self._max_age_s}

    def unresponsive(self, worker_id: str) -> bool:
        """Whether the worker stopped answering its load probes: nothing listens on its port,
        or every probe for ``silent_after_s`` failed (a stopped or wedged engine stops
        answering its ``/metrics`` too; a busy one answers late now and then)."""
        silence = self._failing.get(worker_id)
        return silence is not None and silence.unresponsive(self._clock(),
                                                            self._silent_after_s)

    async def _poll_one(self, client: httpx.AsyncClient, worker: WorkerRecord) -> None:
        worker_id = worker.worker_id
        sent_s = self._clock()
        try:
            # only the three gauges: the whole parse would hold the router's loop ~10 ms
            samples = await fetch_samples(client, worker.http_url, self._timeout_s,
                                          LOAD_SAMPLES)
        except (httpx.HTTPError, ValueError) as exc:
            if self._on_failure is not None:
                self._on_failure(worker.role)
            previous = self._failing.get(worker_id)
            self._failing[worker_id] = ProbeSilence(
                since_s=sent_s if previous is None else previous.since_s,
                refused=isinstance(exc, httpx.ConnectError))
            if previous is None:  # log the transition, not every interval
                logger.warning("cannot read load of %s: %r", worker_id, exc)
            return
        load = worker_load(samples, self._own_in_flight(worker_id), self._clock())
        if load is not None:
            self._loads[worker_id] = load
            if self._failing.pop(worker_id, None) is not None:
                logger.info("load of %s readable again", worker_id)

    async def poll(self) -> None:
        """Scrape every registered worker once, concurrently."""
        client = self._client()
        if client is None:
            return
        workers = self._cluster.workers()
        live = {w.worker_id for w in workers}
        for gone in set(self._loads) - live:
            del self._loads[gone]
        for gone in set(self._failing) - live:
            del self._failing[gone]
        await asyncio.gather(*(self._poll_one(client, w) for w in workers))

    async def _loop(self) -> None:
        while True:
            started = self._clock()
            await self.poll()
            await asyncio.sleep(max(self._interval_s - (self._clock() - started), 0.05))

    def start(self) -> None:
        """Start polling in the background (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pdserve-worker-load")

    async def close(self) -> None:
        await cancel_task(self._task)
        self._task = None
