"""Warm before traffic: the router fills a joining worker's prefix cache (issue 25).

A prefill, aggregated or flex worker that joins starts with an empty prefix cache, so the
requests placement sends it recompute prompts a peer already caches. When it joins (in the
membership update that adds it, :meth:`ClusterSource.on_join`), the router plans with
:func:`router.policy.warm.plan_warm` over the last ``RECENT_REQUESTS`` tokenized, unsalted
requests of its model: those placement would send to it, or send to it when its first choice
(the worker caching them, for a prefix-aware policy) is too busy: their spill target, placement's
choice with that first choice taken out. Each is warmed up to the prefix the policy's cache
model says one of those first choices caches,
newest first, at most ``--warm-tokens`` tokens. Each prefix goes to the worker as a one-token
completion (``max_tokens`` 1, the prompt as token ids), ``WARM_CONCURRENCY`` at a time, booked
through placement like any request: while the worker warms, the load it carries is counted
(placement sends it less), and once a prefix is sent the cache model records it as cached there.
Requests with a ``cache_salt`` are never used: their blocks belong to one key's cache.

Counted in ``pdserve_router_warm_requests_total{role,outcome}`` and
``pdserve_router_warm_tokens_total{role}``; ``pdserve_router_warming_workers{role}`` is the
workers warming now (a client that needs a settled fleet waits for 0); logged as ``warm:
worker W took N prefixes (T tokens) in S s``. A warm request that fails is counted and
dropped (the worker serves cold).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from router.policy.base import RouteRequest
from router.policy.hashing import DEFAULT_BLOCK_TOKENS
from router.policy.warm import WarmPrefix, plan_warm
from router.state.registry import WorkerRecord

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from router.api.proxy import PDProxy

logger = logging.getLogger(__name__)

WARM_ROLES = ("prefill", "aggregated", "flex")
"""Roles whose prefix cache a request's prompt lands in (decode pulls it)."""
RECENT_REQUESTS = 512
"""Recent requests per model the plan looks through."""
WARM_CONCURRENCY = 2
"""Warm requests in flight per joining worker."""
WARM_TIMEOUT_S = 60.0


class Warmer:
    """Remembers recent requests; warms each worker that joins (see the module docstring)."""

    def __init__(self, proxy: PDProxy, budget_tokens: int,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.proxy = proxy
        self.budget_tokens = budget_tokens
        self.block_tokens = block_tokens
        self._recent: dict[str, deque[RouteRequest]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def saw(self, route: RouteRequest) -> None:
        """A request was admitted with these tokenizer ids, no ``cache_salt``."""
        if self.budget_tokens > 0 and route.prompt_token_ids:
            self._recent.setdefault(route.model, deque(maxlen=RECENT_REQUESTS)).append(route)

    def pools_of(self, record: WorkerRecord) -> list[str]:
        """The placement pools that place whole prompts on ``record``."""
        proxy = self.proxy
        return [role for role in ("prefill", record.role) if role in proxy.placement.pools
                and any(r.worker_id == record.worker_id
                        for r in proxy.live(role, record.model))]

    def plan(self, record: WorkerRecord) -> tuple[str, list[WarmPrefix]]:
        """The pool to book in and the prefixes to warm ``record`` with (pure but for reading
        the router's state)."""
        proxy, wid = self.proxy, record.worker_id
        pools = self.pools_of(record)
        recent = self._recent.get(record.model)
        if not pools or not recent:
            return "", []
        loads = proxy.reported_loads()
        offers = {}
        for role in pools:
            live = [r for r in proxy.live(role, record.model)
                    if not proxy.cluster.leaving(r.worker_id)]
            pool = proxy.placement.pool(role)
            pool.sync(record.model, (r.worker_id for r in proxy.live(role, record.model)))
            offers[role] = (pool, proxy.tracker.candidates(live, loads),
                            [r.worker_id for r in live])

        first: dict[str, set[str]] = {}
        """Per request id: the workers placement would try for it ahead of ``wid``."""

        def choose(route: RouteRequest) -> str | None:
            # placement's choice, and where the request goes when that worker is too busy to
            # take it (its spill target): two policy calls, whatever the fleet's size
            ahead = first.setdefault(route.request_id, set())
            for pool, candidates, _ in offers.values():
                choice = pool.choose(route, candidates)
                if choice is None:
                    continue
                if choice.worker != wid:
                    ahead.add(choice.worker)
                    choice = pool.choose(route, [c for c in candidates
                                                 if c.worker_id != choice.worker])
                if choice is not None and choice.worker == wid:
                    return wid
            return None

        def blocks(role: str, route: RouteRequest, worker: str) -> int:
            return offers[role][0].cached_tokens(route, worker) // self.block_tokens

        def held(route: RouteRequest, target: str) -> int:
            peers = first.get(route.request_id) or {
                w for _, _, ids in offers.values() for w in ids if w != target}
            return max((blocks(role, route, w) for role in offers for w in peers), default=0)

        def have(route: RouteRequest, target: str) -> int:
            return max(blocks(role, route, target) for role in offers)

        plans = plan_warm(list(recent), choose, lambda w: w == wid, have, held,
                          lambda route: route.block_hashes,
                          max(self.budget_tokens // self.block_tokens, 1))
        return pools[0], plans.get(wid, [])

    def joined(self, records: Sequence[WorkerRecord]) -> None:
        """Start warming each prefill-role worker that joined."""
        for record in records:
            if record.role not in WARM_ROLES:
                continue
            role, prefixes = self.plan(record)
            if prefixes:
                task = asyncio.get_running_loop().create_task(
                    self._warm(role, record, prefixes), name=f"pdserve-warm-{record.worker_id}")
                self._tasks.add(task)
                warming = self.proxy.metrics.warming_workers.labels(role=record.role)
                warming.inc()  # in the membership update that adds it: never seen idle first
                task.add_done_callback(functools.partial(self._ended, warming))

    def _ended(self, warming: Gauge, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        warming.dec()

    async def _warm(self, role: str, record: WorkerRecord, prefixes: list[WarmPrefix]) -> None:
        started = time.monotonic()
        gate = asyncio.Semaphore(WARM_CONCURRENCY)
        results = await asyncio.gather(*(self._one(role, record, p, gate) for p in prefixes))
        tokens = sum(results)
        logger.info("warm: worker %s took %d prefixes (%d tokens) in %.2f s", record.worker_id,
                    sum(1 for n in results if n), tokens, time.monotonic() - started)

    async def _one(self, role: str, record: WorkerRecord, prefix: WarmPrefix,
                   gate: asyncio.Semaphore) -> int:
        """Send one prefix; its prompt tokens when answered, else 0."""
        proxy = self.proxy
        ids = prefix.route.prompt_token_ids[:prefix.blocks * self.block_tokens]
        route = RouteRequest(request_id=f"warm-{uuid.uuid4().hex}", model=record.model,
                             prompt_token_ids=ids,
                             block_hashes=prefix.route.block_hashes[:prefix.blocks])
        body = json.dumps({"model": record.model, "prompt": list(ids), "max_tokens": 1,
                           "temperature": 0}).encode()
        async with gate:
            if proxy.cluster.leaving(record.worker_id) or not any(
                    r.worker_id == record.worker_id for r in proxy.live(role, record.model)):
                return 0
            proxy.begin(role, route, record)
            ok = False
            try:
                resp = await proxy.send(f"{record.http_url}/v1/completions", body,
                                        proxy.worker_headers(route.request_id),
                                        httpx.Timeout(WARM_TIMEOUT_S), stream=False)
                ok = resp.status_code == 200
                if not ok:
                    logger.warning("warm request to %s answered %d", record.worker_id,
                                   resp.status_code)
            except httpx.HTTPError as exc:
                logger.warning("warm request to %s failed: %r", record.worker_id, exc)
            finally:
                proxy.end(role, route, record, ok)
        proxy.metrics.warm_requests.labels(role=record.role,
                                           outcome="ok" if ok else "error").inc()
        if not ok:
            return 0
        proxy.metrics.warm_tokens.labels(role=record.role).inc(len(ids))
        return len(ids)

    def start(self) -> None:
        """Warm every worker that joins from now on (``budget_tokens`` 0: never)."""
        if self.budget_tokens > 0:
            self.proxy.cluster.on_join(self.joined)

    async def settled(self) -> None:
        """Until every warming started so far has ended."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop warming."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
