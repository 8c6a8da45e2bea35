"""The prefill -> decode proxy: worker choice, the two upstream calls, retries and SSE relay.

Workers are chosen and booked through :class:`router.placement.Placement`; relaying answers is
:mod:`router.api.relay`, upstream errors and the same-worker retry rule :mod:`router.api.upstream`.

Prefill failures (connect, timeout, 5xx, no ``kv_transfer_params``) are retried on another prefill
worker; decode failures are retried on another decode worker as long as no byte reached the
client. A decode that may have received the prefill's ``kv_transfer_params`` may have pulled and
released that lease (its blocks may hold another request's KV by now), so its retry carries no
params and computes the prompt itself; only a decode that was never reached (connect refused)
is retried with them. Once a stream has started, an upstream failure moves it to another
worker, which continues from the ids already sent (``router.api.resume``); a stream that cannot
move ends with one ``data: {"error": ...}`` event and ``data: [DONE]``. Every upstream call has
a connect and a read timeout, so nothing waits forever. Upstream 4xx answers are the client's fault
and are relayed unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

import httpx
from starlette.responses import Response

from kvtransfer.signing import Keyring, KeyringFile, current, strip_signature
from router.api.chunk_feed import feed_of
from router.api.first_token import FirstToken, first_events, resumable
from router.api.journal import StreamJournal
from router.api.redispatch import Redispatch, Waiting, WaitingRequests, log_move
from router.api.relay import FirstOutput, RelayResponse, relay_body
from router.api.resume import PROBE_CHECK_S, ResumableStream, Source
from router.api.rewrite import decode_body, encode, prefill_body
from router.api.schemas import Endpoint
from router.api.stream_end import failed_ending
from router.api.timeline import PhaseClock
from router.api.transport import UpstreamTransport
from router.api.unspent import UnspentLeases
from router.api.upstream import (
    allow_same_worker_retry,
    may_have_reached,
    no_workers,
    upstream_error,
)
from router.api.usage import StreamWatch, Usage, body_usage
from router.api.worker_params import foreign_kv_params
from router.config import RouterSettings
from router.errors import UpstreamError
from router.metrics import RouterMetrics
from router.placement import Placement
from router.policy.base import Candidate, RouteRequest
from router.state.cluster import ClusterSource
from router.state.load import LoadTracker
from router.state.registry import WorkerRecord
from router.state.worker_load import WorkerLoad

logger = logging.getLogger(__name__)

FALLBACK_ROLES = ("decode", "aggregated", "prefill")
"""Pools a request may finish in when its own has nobody left (see ``choose_fallback``)."""

_FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate")
URL_CACHE = 1024
"""Parsed worker URLs kept (workers x endpoints; more means churn: the cache starts over)."""


class PDProxy:
    """Runs one request through a prefill worker and a decode worker."""

    def __init__(
        self,
        settings: RouterSettings,
        cluster: ClusterSource,
        metrics: RouterMetrics,
        placement: Placement,
        tracker: LoadTracker,
        client: httpx.AsyncClient,
        reported_loads: Callable[[], Mapping[str, WorkerLoad]] = dict,
        on_done: Callable[[PhaseClock, int], None] = lambda clock, status: None,
        keyring: Keyring | KeyringFile | None = None,
        unresponsive: Callable[[str], bool] = lambda worker_id: False,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.cluster = cluster
        self.metrics = metrics
        self.placement = placement
        """Chooses and books every worker (its ledger is ``tracker``); the prefill pool places
        prefill and aggregated workers together, the aggregated pool aggregated ones alone."""
        self.tracker = tracker
        self.client = client
        self.reported_loads = reported_loads
        """Workers' own fresh load reports (:class:`WorkerLoadPoller.loads`)."""
        self.on_done = on_done
        """Called once when a relayed stream ends (its timeline is complete)."""
        self.keyring = keyring
        """Signs every ``kv_transfer_params`` sent to a worker (None: unsigned)."""
        self.unresponsive = unresponsive
        """Whether a worker stopped answering its load probes (a stream waiting on it moves)."""
        self.transport = transport
        """``client``'s transport, called directly by :meth:`send` (past the client's cookie,
        auth, redirect and default-header handling, which no worker call uses: a tenth of the
        router's CPU per request); None: calls go through ``client``."""
        self._prefill_timeout = httpx.Timeout(settings.prefill_timeout_s,
                                              connect=settings.connect_timeout_s)
        self._decode_timeout = httpx.Timeout(settings.decode_timeout_s,
                                             connect=settings.connect_timeout_s)
        self.unspent = UnspentLeases(
            lambda: self.client, lambda model: self.live("decode", model), self.signed,
            self.worker_headers,
            lambda outcome: metrics.unspent_kv_releases.labels(outcome=outcome).inc(),
            timeout_s=settings.connect_timeout_s + 5.0)
        """Frees the prefill leases of params no decode received (``router.api.unspent``)."""
        self.waiting = WaitingRequests()
        """Streams sent and not yet answered, per worker (``router.api.redispatch``)."""
        self._urls: dict[str, httpx.URL] = {}
        """Worker URLs parsed once (a worker's endpoints are few; parsing one each call cost
        the router a thirtieth of its CPU per request)."""

    # -- bookkeeping -------------------------------------------------------------------------

    def live(self, role: str, model: str) -> list[WorkerRecord]:
        """Workers placed by ``role``'s policy; in a mixed fleet the prefill policy places
        prefill and aggregated workers together (an aggregated pick serves the whole request).
        Flex workers serve in every pool: prefill, decode and ``flex`` (whole requests)."""
        live = self.cluster.workers(role, model)
        if role == "prefill":
            live += self.cluster.workers("aggregated", model)
        if role in ("prefill", "decode"):
            live += self.cluster.workers("flex", model)
        return live

    def choose(self, role: str, route: RouteRequest, tried: set[str]) -> WorkerRecord | None:
        """The ``role`` worker placement picks for ``route`` among the live ones not in
        ``tried`` (added to it); None when there is none. Nothing is booked (``begin``)."""
        live = self.live(role, route.model)
        pool = self.placement.pool(role)
        pool.sync(route.model, (r.worker_id for r in live))
        records = [r for r in live if r.worker_id not in tried]
        candidates = self.tracker.candidates(records, self.reported_loads())
        choice = pool.choose(route, candidates)
        if choice is None:
            return None
        self.metrics.routing_decisions.labels(role=role, reason=choice.reason).inc()
        worker = next(r for r in records if r.worker_id == choice.worker)
        tried.add(worker.worker_id)
        return worker

    def choose_fallback(self, role: str, route: RouteRequest, tried: set[str]
                        ) -> tuple[WorkerRecord | None, str]:
        """When ``role``'s pool has no worker left to try: one from another pool whose engines
        can serve the request whole (decode, aggregated, then prefill: every vLLM engine can),
        and that pool's name (it books the worker); none with ``role_fallback`` off."""
        if not self.settings.role_fallback:
            return None, role
        for other in FALLBACK_ROLES:
            if other != role:
                worker = self.choose(other, route, tried)
                if worker is not None:
                    return worker, other
        return None, role

    async def _choose_or_wait(self, role: str, route: RouteRequest,
                              tried: set[str]) -> WorkerRecord | None:
        """``choose``; when the pool is empty (a membership blip: an evicted worker, a restart)
        wait up to ``no_worker_wait_s`` for one instead of failing an admitted request."""
        worker = self.choose(role, route, tried)
        if worker is not None or tried:
            return worker
        deadline = time.monotonic() + self.settings.no_worker_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            worker = self.choose(role, route, tried)
            if worker is not None:
                return worker
        return None

    def pool(self, role: str, model: str) -> list[Candidate]:
        """Load snapshots of the workers ``role``'s policy places among (admission control)."""
        return self.tracker.candidates(self.live(role, model), self.reported_loads())

    def peek_decode(self, route: RouteRequest) -> WorkerRecord | None:
        """The decode worker the decode policy would pick now (nothing is recorded)."""
        live = self.live("decode", route.model)
        candidates = self.tracker.candidates(live, self.reported_loads())
        choice = self.placement.pool("decode").choose(route, candidates)
        return None if choice is None else next(r for r in live if r.worker_id == choice.worker)

    def begin(self, role: str, route: RouteRequest, worker: WorkerRecord) -> None:
        """``route`` is being sent to ``worker``: placement and the in-flight gauge count it."""
        self.placement.pool(role).begin(route, worker.worker_id)
        self.metrics.in_flight.labels(role=role).inc()

    def end(self, role: str, route: RouteRequest, worker: WorkerRecord, ok: bool) -> None:
        """``worker`` is done with ``route`` (``ok``: it answered)."""
        self.placement.pool(role).end(route, worker.worker_id, ok)
        self.metrics.in_flight.labels(role=role).dec()

    def _account(self, clock: PhaseClock, model: str, usage: Usage | None,
                 watch: StreamWatch | None = None) -> None:
        """Token counters from an answer's usage (and the clock's output count, which settles
        its key's token budget); a stream's inter-token gaps, from its ``watch``."""
        gaps = watch.gaps if watch is not None else None
        clock.output_tokens = usage.completion_tokens if usage is not None else None
        clock.output_events = watch.content_events if watch is not None else 0
        if usage is not None:
            self.metrics.prompt_tokens.labels(model_name=model).inc(usage.prompt_tokens)
            self.metrics.generation_tokens.labels(model_name=model).inc(
                usage.completion_tokens)
        if gaps:
            itl = self.metrics.inter_token_latency.labels(model_name=model)
            for gap in gaps:
                itl.observe(gap)

    def _failed(self, worker: WorkerRecord, err: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(role=err.role, kind=err.kind).inc()
        self.tracker.mark_failed(worker.worker_id)
        if err.kind == "connect":  # nobody listens: out of the rings until it answers again
            self.cluster.evict(worker.worker_id)
        logger.warning("%s", err.message)

    async def watched(self, worker: WorkerRecord, role: str,
                      call: Coroutine[Any, Any, httpx.Response],
                      route: RouteRequest | None = None) -> httpx.Response:
        """``call``'s answer, unless ``worker`` stops answering the router's load probes while
        it waits (a stopped or wedged engine; a busy one still answers): then the call is
        abandoned (its connection closed: vLLM aborts the request once it runs again) and a
        ``stall`` error raised, so the request goes elsewhere (``stall_timeout_s`` 0: off).
        With ``route`` the wait is registered for re-dispatch (``router.api.redispatch``):
        moved, the call is abandoned the same way and :class:`Redispatch` raised."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        why: list[Exception] = []  # what the call was stopped for, raised once our cancel lands
        finished = False

        def stop(error: Exception) -> bool:
            if why or finished:
                return False
            why.append(error)
            task.cancel()  # the call runs in ``task`` itself: no task of its own to create
            return True

        entry = None
        if route is not None:
            entry = Waiting(route, role, worker.worker_id, time.monotonic(),
                            lambda target: stop(Redispatch(target)))
            self.waiting.add(entry)
        timer: asyncio.TimerHandle | None = None

        def probe() -> None:
            nonlocal timer
            if self.unresponsive(worker.worker_id):
                stop(UpstreamError(f"{role} worker {worker.worker_id} stopped answering while "
                                   "the request waited on it", role=role, kind="stall",
                                   status=504, code="upstream_timeout"))
            else:
                timer = loop.call_later(PROBE_CHECK_S, probe)

        if self.settings.stall_timeout_s > 0:
            timer = loop.call_later(PROBE_CHECK_S, probe)
        try:
            return await call
        except asyncio.CancelledError:
            if why and task.uncancel() <= cancelling:  # ours alone: the call was abandoned
                raise why[0] from None
            raise
        finally:
            finished = True
            if timer is not None:
                timer.cancel()
            if entry is not None:
                self.waiting.discard(entry)

    def redispatched(self, clock: PhaseClock, role: str, route: RouteRequest,
                     source: WorkerRecord, target: WorkerRecord) -> None:
        """Book a waiting request's re-dispatch: off ``source`` (not ok), onto ``target``;
        counted and put in the timeline."""
        self.end(role, route, source, ok=False)
        self.metrics.redispatches.labels(role=role).inc()
        log_move(role, route.request_id, source.worker_id, target.worker_id)
        clock.moves.append({"from": source.worker_id, "to": target.worker_id,
                            "reason": "redispatch", "at": time.time(), "sent_tokens": 0})
        self.begin(role, route, target)

    def _headers(self, route: RouteRequest, incoming: dict[str, str]) -> dict[str, str]:
        headers = {"content-type": "application/json", "x-request-id": route.request_id}
        for name in _FORWARDED_HEADERS:
            if name in incoming:
                headers[name] = incoming[name]
        if self.settings.api_keys:  # the router's key stays at the router
            headers.pop("authorization", None)
        keyring = current(self.keyring)
        if keyring is not None:  # workers' vLLM takes only the key derived from the secret
            headers["authorization"] = f"Bearer {keyring.worker_api_keys[0]}"
        return headers

    def worker_headers(self, request_id: str) -> dict[str, str]:
        """Headers of a call the router itself makes to a worker (a lease release, a warm
        request): JSON, the request id and the workers' key."""
        headers = {"content-type": "application/json", "x-request-id": request_id}
        keyring = current(self.keyring)
        if keyring is not None:
            headers["authorization"] = f"Bearer {keyring.worker_api_keys[0]}"
        return headers

    def release_unspent(self, route: RouteRequest, kv_params: dict[str, Any]) -> None:
        """The request ends and no decode received ``kv_params``: free the prefill's lease now
        (``release_unspent_kv``; off: it expires after ``kv_lease_s``)."""
        if self.settings.release_unspent_kv:
            self.unspent.release(route.model, route.request_id, kv_params)

    def signed(self, params: dict[str, Any], worker: WorkerRecord) -> dict[str, Any]:
        """``params`` signed for one call to ``worker`` (kvtransfer.signing: bound to its
        engine id, accepted once), or as they are without a keyring; a signature the params
        came with is never passed on."""
        keyring = current(self.keyring)
        params = strip_signature(params)
        return params if keyring is None else keyring.sign(params, time.time(),
                                                           target=worker.engine_id)

    async def send(self, url: str, content: bytes, headers: dict[str, str],
                   timeout: httpx.Timeout, *, stream: bool) -> httpx.Response:
        """POST ``content`` to a worker: the answer with its body unread when ``stream``
        (the caller closes it), else read whole."""
        if self.transport is None:
            request = self.client.build_request("POST", url, content=content, headers=headers,
                                                timeout=timeout)
            return await self.client.send(request, stream=stream)
        if isinstance(self.transport, UpstreamTransport):
            resp = await self.transport.post(self._url(url), content, headers,
                                             timeout.as_dict())
        else:
            request = httpx.Request("POST", self._url(url), content=content, headers=headers,
                                    extensions={"timeout": timeout.as_dict()})
            resp = await self.transport.handle_async_request(request)
        if not stream:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
        return resp

    def _url(self, url: str) -> httpx.URL:
        """``url`` parsed, from the cache (emptied when it passes ``URL_CACHE`` entries)."""
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= URL_CACHE:
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        return parsed

    # -- prefill -----------------------------------------------------------------------------

    async def prefill(
        self, endpoint: Endpoint, body: dict[str, Any], route: RouteRequest,
        incoming: dict[str, str], clock: PhaseClock, *, token_ids: bool = False,
        first_choice: WorkerRecord | None = None,
    ) -> tuple[dict[str, Any], WorkerRecord, Any] | WorkerRecord | Response:
        """Run the prefill; returns (kv_transfer_params, worker, the prefill's JSON answer) or a
        relayed 4xx response; in a mixed fleet, the aggregated worker the prefill policy chose
        instead (nothing sent yet). ``token_ids`` asks for the prompt's and the sampled token's
        ids; ``first_choice`` is a worker already chosen for the first attempt."""
        out = prefill_body(endpoint, body, token_ids=token_ids)
        ask = out["kv_transfer_params"]
        headers = self._headers(route, incoming)
        tried: set[str] = set()
        retried: set[str] = set()
        last: UpstreamError | None = None
        for attempt in range(self.settings.prefill_retries + 1):
            if attempt == 0 and first_choice is not None:
                worker: WorkerRecord | None = first_choice
                tried.add(first_choice.worker_id)
            else:
                worker = await self._choose_or_wait("prefill", route, tried)
            if worker is None:
                break
            if worker.role == "aggregated":
                return worker
            clock.mark("prefill_chosen")
            if attempt:
                self.metrics.upstream_retries.labels(role="prefill").inc()
            logger.debug("prefill on %s (attempt %d)", worker.worker_id, attempt + 1)
            self.begin("prefill", route, worker)
            started = time.perf_counter()
            ok = False
            try:
                while True:
                    out["kv_transfer_params"] = self.signed(ask, worker)
                    try:
                        resp = await self.watched(worker, "prefill", self.send(
                            worker.http_url + endpoint.path, encode(out), headers,
                            self._prefill_timeout, stream=False), route)
                        break
                    except Redispatch as move:  # queued there: the same attempt, elsewhere
                        self.redispatched(clock, "prefill", route, worker, move.target)
                        worker = move.target
                        tried.add(worker.worker_id)
                ok = resp.status_code < 500
            except httpx.HTTPError as exc:
                last = upstream_error("prefill", worker, exc)
                self._failed(worker, last)
                allow_same_worker_retry(exc, worker, tried, retried)
                continue
            except UpstreamError as err:  # it stopped answering: the next one
                last = err
                self._failed(worker, last)
                continue
            finally:
                self.end("prefill", route, worker, ok)
            if resp.status_code >= 500:
                last = UpstreamError(
                    f"prefill worker {worker.worker_id} answered {resp.status_code}: "
                    f"{resp.text[:500]}", role="prefill", kind="status")
                self._failed(worker, last)
                continue
            if resp.status_code >= 400:
                logger.info("prefill worker %s rejected the request with %d",
                            worker.worker_id, resp.status_code)
                return relay_body(resp.content, resp.status_code,
                                   resp.headers.get("content-type"))
            data = _json(resp)
            params = _kv_transfer_params(data)
            if params is None:
                last = UpstreamError(
                    f"prefill worker {worker.worker_id} answered without kv_transfer_params "
                    "(is the KV connector configured as producer?)", role="prefill",
                    kind="missing_kv_transfer_params", code="missing_kv_transfer_params")
                self._failed(worker, last)
                continue
            why = foreign_kv_params(params, worker)
            if why is not None:  # never sign what would point a decode elsewhere
                last = UpstreamError(f"prefill worker {worker.worker_id} answered "
                                     f"kv_transfer_params not its own: {why}", role="prefill",
                                     kind="foreign_kv_params", code="foreign_kv_params")
                self._failed(worker, last)
                continue
            self.tracker.mark_ok(worker.worker_id)
            self.metrics.prefill_duration.labels(
                endpoint=endpoint.name, model_name=route.model).observe(
                time.perf_counter() - started)
            clock.mark("prefill_answered")
            return params, worker, data
        if last is None:
            raise no_workers("prefill", route.model)
        raise last

    # -- decode ------------------------------------------------------------------------------

    async def decode(
        self, endpoint: Endpoint, body: dict[str, Any], kv_params: dict[str, Any] | None,
        route: RouteRequest, incoming: dict[str, str], *, stream: bool, clock: PhaseClock,
        role: str = "decode", first_choice: WorkerRecord | None = None,
    ) -> Response:
        """Run the decode (``kv_params`` from the prefill), or the whole request on one worker
        (``kv_params`` None: a decode worker skipping the prefill hop, or an aggregated worker,
        ``role``); ``first_choice`` is a worker already chosen for the first attempt."""
        movable = stream and self.settings.migration_limit > 0 and resumable(endpoint, body)
        if movable:  # the ids let the stream continue elsewhere (router.api.resume)
            body = {**body, "return_token_ids": True}
        plain = encode(body)
        headers = self._headers(route, incoming)
        tried: set[str] = set()
        retried: set[str] = set()
        last: UpstreamError | None = None
        last_exc: Exception | None = None  # None after a failed attempt: the worker answered
        spent = False  # a decode may have pulled: every later attempt computes the prompt
        handed = kv_params is None  # a decode answered a request that carried them
        try:
            for attempt in range(self.settings.decode_retries + 1):
                if attempt and kv_params is not None:
                    spent = spent or may_have_reached(last_exc)
                    if spent:
                        self.metrics.kv_params_withdrawn.inc()
                last_exc = None
                pool = role
                if attempt == 0 and first_choice is not None:
                    worker: WorkerRecord | None = first_choice
                    tried.add(first_choice.worker_id)
                else:
                    worker = await self._choose_or_wait(role, route, tried)
                    if worker is None and tried:  # its pool has nobody left: any engine, whole
                        worker, pool = self.choose_fallback(role, route, tried)
                if worker is None:
                    break
                clock.mark("decode_chosen")
                if attempt:
                    self.metrics.upstream_retries.labels(role=role).inc()
                logger.debug("%s on %s (attempt %d)", pool, worker.worker_id, attempt + 1)
                self.begin(pool, route, worker)
                content = plain if kv_params is None or spent or pool != "decode" else \
                    encode(decode_body(body, self.signed(kv_params, worker)))
                carries = content is not plain
                call = self.send(worker.http_url + endpoint.path, content, headers,
                                 self._decode_timeout, stream=True)
                handed_over = ok = False
                try:
                    try:
                        while True:
                            try:
                                resp = await self.watched(worker, pool, call,
                                                          None if stream else route)
                                break
                            except Redispatch as move:  # queued there: sent elsewhere
                                self.redispatched(clock, pool, route, worker, move.target)
                                # a decode that got the params frees them on its abort
                                handed, spent = handed or carries, spent or carries
                                worker, content, carries = move.target, plain, False
                                tried.add(worker.worker_id)
                                call = self.send(worker.http_url + endpoint.path, content,
                                                 headers, self._decode_timeout, stream=True)
                    except UpstreamError as err:  # it stopped answering: the next one
                        last, last_exc = err, None
                        self._failed(worker, last)
                        continue
                    handed = handed or (carries and resp.status_code < 400)
                    try:
                        if resp.status_code >= 500:
                            detail = (await resp.aread())[:500].decode(errors="replace")
                            last = UpstreamError(
                                f"{pool} worker {worker.worker_id} answered {resp.status_code}: "
                                f"{detail}", role=pool, kind="status")
                            self._failed(worker, last)
                            continue
                        if resp.status_code >= 400 or not stream:
                            data = await resp.aread()
                            clock.mark("decode_first_byte")
                            ok = True
                            if resp.status_code < 400:
                                self.tracker.mark_ok(worker.worker_id)
                                self._account(clock, route.model, body_usage(data))
                            return relay_body(data, resp.status_code,
                                               resp.headers.get("content-type"))
                        if movable:  # it waits for the first chunk itself, and can move on
                            handed_over = True
                            resumed = ResumableStream(self, endpoint, body, route, incoming, clock,
                                                      StreamJournal(endpoint, body), role=pool)
                            resumed.adopt(Source(worker, pool, resp, feed_of(resp)))
                            return resumed.response()
                        chunks = resp.aiter_raw()
                        first = b""
                        async for chunk in chunks:
                            if chunk:
                                first = chunk
                                break
                        clock.mark("decode_first_byte")
                        handed_over = True
                        self.tracker.mark_ok(worker.worker_id)
                        return self._relay(endpoint, route, worker, resp, chunks, first, clock,
                                           pool)
                    finally:
                        if not handed_over:
                            await resp.aclose()
                except httpx.HTTPError as exc:
                    last, last_exc = upstream_error(pool, worker, exc), exc
                    self._failed(worker, last)
                    allow_same_worker_retry(exc, worker, tried, retried)
                    continue
                finally:
                    if not handed_over:
                        self.end(pool, route, worker, ok=ok)
            if last is None:
                raise no_workers(role, route.model)
            raise last
        finally:
            if not handed:
                assert kv_params is not None
                self.release_unspent(route, kv_params)

    def continue_stream(
        self, endpoint: Endpoint, body: dict[str, Any], first: FirstToken,
        kv_params: dict[str, Any], route: RouteRequest, incoming: dict[str, str],
        clock: PhaseClock, first_choice: WorkerRecord | None = None,
    ) -> RelayResponse:
        """Stream the prefill's token now, then the decode's continuation from it (see
        ``router.api.first_token``), moved to another worker if its decode fails
        (``router.api.resume``). ``first_choice`` is a decode worker already chosen."""
        journal = StreamJournal(endpoint, body, prompt_ids=first.prompt_token_ids,
                                committed=(first.token_id,), response_id=first.response_id)
        stream = ResumableStream(self, endpoint, body, route, incoming, clock, journal,
                                 head=first_events(endpoint, first, body), kv_params=kv_params,
                                 first_choice=first_choice)
        return stream.response()

    def _relay(
        self, endpoint: Endpoint, route: RouteRequest, worker: WorkerRecord,
        resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes, clock: PhaseClock,
        role: str = "decode",
    ) -> RelayResponse:
        state = {"done": False, "ok": True}
        detector = FirstOutput()
        watch = StreamWatch()
        metrics = self.metrics

        def saw(chunk: bytes) -> None:
            now = time.perf_counter()
            watch.feed(chunk, now)
            if not detector.found and detector.feed(chunk):
                clock.saw_first_output(now)
                metrics.ttft.labels(endpoint=endpoint.name, model_name=route.model).observe(
                    now - clock.started)

        async def body() -> AsyncIterator[bytes]:
            tail = first[-2:]
            if first:
                saw(first)
                yield first
            try:
                async for chunk in chunks:
                    if chunk:
                        saw(chunk)
                        tail = (tail + chunk)[-2:]
                        yield chunk
            except httpx.HTTPError as exc:
                state["ok"] = False
                err = upstream_error(role, worker, exc)
                self._failed(worker, err)
                event = {"error": {"message": f"decode failed mid-stream: {err.public_message}",
                                   "type": "upstream_error", "param": None,
                                   "code": "upstream_stream_error"}}
                sep = b"" if tail in (b"", b"\n\n") else b"\n\n"
                yield sep + failed_ending(watch, event, chat=endpoint.chat, model=route.model)

        async def cleanup() -> None:
            if state["done"]:
                return
            state["done"] = True
            # Bookkeeping first: the await below may be interrupted by cancellation.
            self.end(role, route, worker, ok=state["ok"])
            clock.mark("done")
            clock.tpot_s = sum(watch.gaps) / len(watch.gaps) if watch.gaps else None
            metrics.requests.labels(endpoint=endpoint.name, status=str(resp.status_code),
                                    model_name=route.model).inc()
            metrics.request_duration.labels(endpoint=endpoint.name,
                                            model_name=route.model).observe(
                clock.mono["done"] - clock.started)
            self._account(clock, route.model, watch.usage, watch)
            self.on_done(clock, resp.status_code)
            await resp.aclose()

        return RelayResponse(body(), status_code=resp.status_code,
                             media_type=resp.headers.get("content-type", "text/event-stream"),
                             cleanup=cleanup)


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _kv_transfer_params(data: Any) -> dict[str, Any] | None:
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) and params else None
