"""A client stream that outlives the worker serving it (the re-plan of ARCHITECTURE's "Paths").

Every stream the router can continue elsewhere (``first_token.resumable``) runs here, whatever
its path: whole on one worker, classic P/D, or P/D continuing from the prefill's first token.
The stream is a sequence of *sources*: the first one is the client's own request (or the
decode's continuation from the prefill's token); when a source fails, the next one is a
continuation from the prompt's ids plus the ids the client already has
(``StreamJournal.continuation``), on another live worker that can serve the model: the same
pool first, then decode, aggregated and prefill workers (any vLLM engine can finish a request).

A source fails when its worker refuses the connection, resets it, times out, answers 5xx or an
error event, ends without a finish, or stalls: it sent output and then nothing for
``stall_timeout_s`` (or 25 times the stream's recent median gap, if longer), or, before its
first output, its worker stopped answering the router's load probes (a stopped or wedged engine;
a busy one still answers). Closing the failed connection aborts the request on that worker (vLLM
aborts on disconnect; a stopped worker does so when it resumes). A source that failed before the
client got anything, and before the prompt's ids were known, is sent again as it was.

A stream whose worker is leaving (the registry's draining set, as a scale-down's drain or a
SIGTERMed worker writes it, or a deregistration) moves at the next event it relays, or, while
it waits for its first output (queued or prefilling there), within ``PROBE_CHECK_S``: sent
again elsewhere, so a drain waits for no stream to finish or start; the move counts as
``drain``, not as the worker failing.

A failure before the source sent anything is a retry (``decode_retries`` of them); after, a
*move* (``migration_limit`` of them, counted by ``pdserve_router_migrations_total`` and listed
in the timeline and trace). A continuation never
carries ``kv_transfer_params`` once a decode may have pulled them (their lease may be released).
The client sees one stream: one id, no error event, usage counting every generated token once.
Only a stream that cannot move ends with one error event and ``[DONE]``, as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from router.api.chunk_feed import ChunkFeed, feed_of
from router.api.journal import StreamJournal
from router.api.redispatch import Waiting, log_move
from router.api.relay import FirstOutput, RelayResponse
from router.api.rewrite import decode_body, encode
from router.api.schemas import Endpoint
from router.api.stream_end import failed_ending
from router.api.timeline import PhaseClock
from router.api.upstream import allow_same_worker_retry, may_have_reached, upstream_error
from router.api.usage import StreamWatch
from router.errors import UpstreamError
from router.policy.base import RouteRequest
from router.state.registry import WorkerRecord

if TYPE_CHECKING:
    from router.api.proxy import PDProxy

STALL_GAP_FACTOR = 25.0
"""A stall is this many of the stream's recent median gaps (when longer than the floor)."""
PROBE_CHECK_S = 0.25
"""How often a source waiting for its first output checks its worker's probes."""


@dataclass
class Source:
    """One upstream answer relayed into the client's stream."""

    worker: WorkerRecord
    role: str
    """The pool that booked the worker."""
    response: httpx.Response
    feed: ChunkFeed
    native: bool = True
    """The client's own request (else a continuation on ``/v1/completions``)."""


class _Stalled(Exception):
    """The source sent output, then nothing for the stall bound."""


class _Leaving(Exception):
    """The source's worker is draining or deregistered: its streams move before it stops."""


class _Redispatched(Exception):
    """The request still queued on the source's worker moves to one that can start it sooner
    (``router.api.redispatch``)."""


class ResumableStream:
    """One client stream across sources (see the module docstring)."""

    def __init__(self, proxy: PDProxy, endpoint: Endpoint, body: dict[str, Any],
                 route: RouteRequest, incoming: dict[str, str], clock: PhaseClock,
                 journal: StreamJournal, *, role: str = "decode", head: bytes = b"",
                 kv_params: dict[str, Any] | None = None,
                 first_choice: WorkerRecord | None = None) -> None:
        self.proxy = proxy
        self.endpoint = endpoint
        self.body = body
        self.route = route
        self.incoming = incoming
        self.clock = clock
        self.journal = journal
        self.role = role
        self.head = head
        """Events sent before any source (the prefill's first token)."""
        self.kv_params = kv_params
        """The prefill's params, sent with the first continuation while unspent."""
        self._kv_handed = kv_params is None
        """A decode answered a request carrying ``kv_params`` (it reads or frees them); else
        the stream's end releases their lease (``router.api.unspent``)."""
        self.first_choice = first_choice
        self.source: Source | None = None
        self.status = 200
        self._done = False
        self._watch = StreamWatch()
        self._first_output = FirstOutput()
        self._source_output = False
        self._relayed = False
        self._moves = 0
        self._redirect: WorkerRecord | None = None
        """Where re-dispatch asked the waiting request to go (``move_to``)."""
        self._redispatched = False
        self._feed: ChunkFeed | None = None
        """The current source's body while it is read (``move_to`` wakes its wait)."""

    def adopt(self, source: Source) -> None:
        """Start from an answer already open (the client's own request, its status read)."""
        self.source = source
        self.journal.begin(native=True)

    def move_to(self, worker: WorkerRecord) -> bool:
        """Re-dispatch: while its source has sent nothing, the request moves to ``worker``
        (at once: the wait for its first chunk wakes); once in its life. False when it no longer
        can. A chunk already read ahead wins: the request stays."""
        if self._source_output or self._redispatched or self._done or self.source is None:
            return False
        self._redirect, self._redispatched = worker, True
        if self._feed is not None:
            self._feed.wake()  # the wait for the first chunk ends now
        return True

    def response(self) -> RelayResponse:
        """The client's streaming response."""
        media = "text/event-stream"
        if self.source is not None:
            media = self.source.response.headers.get("content-type", media)
        return RelayResponse(self._events(), status_code=200, media_type=media,
                             cleanup=self._cleanup)

    # -- the stream --------------------------------------------------------------------------

    def _saw(self, out: bytes) -> None:
        now = time.perf_counter()
        self._watch.feed(out, now)
        if not self._first_output.found and self._first_output.feed(out):
            self._first(now)

    def _saw_relayed(self) -> None:
        """``_saw`` of what the journal just relayed, from its decoded events."""
        now = time.perf_counter()
        found = self._first_output.found
        for data in self.journal.relayed:
            self._watch.observe(data, now)
            if not found:
                found = self._first_output.observe(data)
        if not found and self.journal.done:
            self._first_output.ended()
            found = True
        if found and self.clock.first_output is None:
            self._first(now)

    def _first(self, now: float) -> None:
        self.clock.saw_first_output(now)
        self.proxy.metrics.ttft.labels(endpoint=self.endpoint.name,
                                       model_name=self.route.model).observe(
            now - self.clock.started)

    async def _events(self) -> AsyncIterator[bytes]:
        proxy, journal, settings = self.proxy, self.journal, self.proxy.settings
        if self.head:
            self._saw(self.head)
            self._relayed = True
            yield self.head
        tried: set[str] = set()
        retried: set[str] = set()
        retries = 0
        spent = self.kv_params is None
        if self.source is not None:
            tried.add(self.source.worker.worker_id)
        while True:
            if self.source is None:
                remaining = journal.remaining()
                if remaining is not None and remaining <= 0:
                    out = journal.finish_event()
                    self._saw(out)
                    yield out
                    return
                if retries or self._moves:
                    proxy.metrics.upstream_retries.labels(role=self.role).inc()
                    if self.kv_params is not None and spent:
                        proxy.metrics.kv_params_withdrawn.inc()
                opened = await self._open(tried, retried, None if spent else self.kv_params)
                if isinstance(opened, UpstreamError):
                    spent = spent or opened.kind != "connect"
                    retries += 1
                    if opened.kind == "no_worker" or retries > settings.decode_retries:
                        yield self._fail(opened, "no_worker" if opened.kind == "no_worker"
                                         else "limit")
                        return
                    continue
                self.source = opened
                journal.begin(native=opened.native)
            source = self.source
            self._source_output = False
            err: UpstreamError | None = None
            exc: Exception | None = None
            try:
                async for chunk in self._chunks(source):
                    out = journal.feed(chunk)
                    if out:
                        if not self._source_output:
                            self.clock.mark("decode_first_byte")
                        self._source_output = self._relayed = True
                        self._saw_relayed()
                        yield out
                    if journal.error is not None:
                        break
                if journal.error is None:
                    out = journal.flush()
                    if out:
                        self._saw_relayed()
                        yield out
                if journal.done:
                    proxy.tracker.mark_ok(source.worker.worker_id)
                    await self._close(ok=True)
                    return
                what = journal.error or "the stream closed before its finish"
                err = UpstreamError(f"{source.role} worker {source.worker.worker_id}: {what}",
                                    role=source.role,
                                    kind="error_event" if journal.error else "truncated")
            except _Stalled:
                err = UpstreamError(f"{source.role} worker {source.worker.worker_id} sent "
                                    "nothing past the stall bound", role=source.role,
                                    kind="stall", status=504, code="upstream_timeout")
            except _Leaving:
                err = UpstreamError(f"{source.role} worker {source.worker.worker_id} is "
                                    "leaving", role=source.role, kind="drain", status=503)
            except _Redispatched:
                target, self._redirect = self._redirect, None
                assert target is not None
                await self._close(ok=False)
                proxy.metrics.redispatches.labels(role=source.role).inc()
                log_move(source.role, self.route.request_id, source.worker.worker_id,
                         target.worker_id)
                self.clock.moves.append({"from": source.worker.worker_id, "to": target.worker_id,
                                         "reason": "redispatch", "at": time.time(),
                                         "sent_tokens": len(journal.committed)})
                spent = True  # it reached the worker: a decode may have taken the params
                tried.discard(target.worker_id)
                self.first_choice = target
                continue
            except httpx.HTTPError as e:
                exc = e
                err = upstream_error(source.role, source.worker, e)
            spent = spent or may_have_reached(exc)
            if err.kind != "drain":  # a leaving worker did nothing wrong
                proxy._failed(source.worker, err)
            await self._close(ok=False)
            if isinstance(exc, httpx.HTTPError) and not self._source_output:
                allow_same_worker_retry(exc, source.worker, tried, retried)
            if self._relayed and not journal.resumable:  # neither continue nor resend
                yield self._fail(err, "not_resumable")
                return
            if not self._source_output:  # nothing reached the client from it: a retry
                retries += 1
                if retries > settings.decode_retries:
                    yield self._fail(err, "limit")
                    return
                continue
            if self._moves >= settings.migration_limit:
                yield self._fail(err, "limit")
                return
            self._moves += 1
            proxy.metrics.migrations.labels(reason=err.kind).inc()
            self.clock.moves.append({"from": source.worker.worker_id, "reason": err.kind,
                                     "at": time.time(), "sent_tokens": len(journal.committed)})

    async def _chunks(self, source: Source) -> AsyncIterator[bytes]:
        """The source's chunks, each wait for them bounded (``router.api.chunk_feed``): past
        the source's first output, a silence longer than the stall bound raises ``_Stalled``;
        before it, so does the worker no longer answering its probes."""
        feed = self._feed = source.feed
        floor = self.proxy.settings.stall_timeout_s
        worker_id = source.worker.worker_id
        entry = Waiting(self.route, source.role, worker_id, time.monotonic(), self.move_to)
        self.proxy.waiting.add(entry)  # until its first chunk (router.api.redispatch)
        waiting: Waiting | None = entry
        try:
            while True:
                data = feed.take()
                if data:
                    if waiting is not None:
                        self.proxy.waiting.discard(waiting)
                        waiting = None
                    self._redirect = None  # answered before the move: it stays
                    yield data
                    if self.proxy.cluster.leaving(worker_id) and self._may_move() \
                            and self.journal.resumable and not self.journal.finished:
                        raise _Leaving()
                    continue
                if feed.ended():
                    return
                if self._redirect is not None:  # woken by move_to
                    raise _Redispatched()
                bound = None
                if not self._source_output:
                    bound = PROBE_CHECK_S
                elif floor > 0:
                    recent = self._watch.gaps[-32:]
                    bound = floor  # unless the stream's own pace is slower (the median only
                    if recent and STALL_GAP_FACTOR * max(recent) > floor:  # then: it can be)
                        bound = max(floor, STALL_GAP_FACTOR * _median(recent))
                if await feed.wait(bound):
                    continue
                if self._source_output or (floor > 0 and self.proxy.unresponsive(worker_id)):
                    raise _Stalled()
                if self.proxy.cluster.leaving(worker_id) and self._may_move():
                    raise _Leaving()  # sent again, or continued, elsewhere
        finally:
            self._feed = None
            if waiting is not None:
                self.proxy.waiting.discard(waiting)
            feed.stop()

    def _may_move(self) -> bool:
        """Whether the stream may still move (a leaving worker otherwise finishes it)."""
        return self._moves < self.proxy.settings.migration_limit

    async def _open(self, tried: set[str], retried: set[str],
                    kv_params: dict[str, Any] | None) -> Source | UpstreamError:
        """A continuation on the next worker; the failure, if it did not start."""
        proxy = self.proxy
        worker, role = await self._choose(tried)
        if worker is None:
            return UpstreamError(f"no live worker can continue the stream of model "
                                 f"'{self.route.model}'", role=self.role, kind="no_worker",
                                 status=503, code="no_workers_available")
        self.clock.mark("decode_chosen")
        if self.clock.moves and "to" not in self.clock.moves[-1]:
            self.clock.moves[-1]["to"] = worker.worker_id
        # the prefill's params go only to a decode (a consumer), and only while unspent
        signed = proxy.signed(kv_params, worker) if kv_params is not None and role == "decode" \
            else None
        native = not self.journal.prompt_ids  # nothing to continue from: the request again
        if native:
            content = self.body if signed is None else decode_body(self.body, signed)
            path = self.endpoint.path
        else:
            content, path = self.journal.continuation(signed), "/v1/completions"
        call = proxy.send(worker.http_url + path, encode(content),
                          proxy._headers(self.route, self.incoming), proxy._decode_timeout,
                          stream=True)
        proxy.begin(role, self.route, worker)
        try:
            resp = await proxy.watched(worker, role, call)
        except httpx.HTTPError as exc:
            proxy.end(role, self.route, worker, ok=False)
            err = upstream_error(role, worker, exc)
            proxy._failed(worker, err)
            allow_same_worker_retry(exc, worker, tried, retried)
            return err
        except UpstreamError as stalled:  # it stopped answering its probes
            proxy.end(role, self.route, worker, ok=False)
            proxy._failed(worker, stalled)
            return stalled
        except BaseException:  # cancelled: the client left while the worker was asked
            proxy.end(role, self.route, worker, ok=False)
            raise
        if resp.status_code >= 400:
            detail = (await resp.aread())[:500].decode(errors="replace")
            await resp.aclose()
            proxy.end(role, self.route, worker, ok=False)
            refused = UpstreamError(f"{role} worker {worker.worker_id} answered "
                                    f"{resp.status_code}: {detail}", role=role, kind="status")
            proxy._failed(worker, refused)
            return refused
        self._kv_handed = self._kv_handed or signed is not None
        return Source(worker, role, resp, feed_of(resp), native)

    async def _choose(self, tried: set[str]) -> tuple[WorkerRecord | None, str]:
        """The next worker: the stream's own pool, then any pool whose engines can finish it;
        while every pool is empty (a restart), wait up to ``no_worker_wait_s`` for one."""
        if self.first_choice is not None and self.first_choice.worker_id not in tried:
            tried.add(self.first_choice.worker_id)
            return self.first_choice, self.role
        deadline = time.monotonic() + self.proxy.settings.no_worker_wait_s
        while True:
            worker = self.proxy.choose(self.role, self.route, tried)
            if worker is not None:
                return worker, self.role
            worker, role = self.proxy.choose_fallback(self.role, self.route, tried)
            if worker is not None:
                return worker, role
            if time.monotonic() >= deadline:
                return None, self.role
            await asyncio.sleep(0.1)

    def _fail(self, err: UpstreamError, why: str) -> bytes:
        """The stream's end when it cannot go on: its open choice finished ``abort``, one error
        event and ``[DONE]`` (``router.api.stream_end``)."""
        self.status = err.status
        if self._first_output.found or self.journal.committed:
            self.proxy.metrics.migrations_refused.labels(reason=why).inc()
        when = "decode failed mid-stream" if self._relayed else "decode failed"
        event = {"error": {"message": f"{when}: {err.public_message}", "type": "upstream_error",
                           "param": None, "code": "upstream_stream_error"}}
        return failed_ending(self._watch, event, chat=self.endpoint.chat,
                             model=self.route.model, response_id=self.journal.response_id or "")

    # -- bookkeeping -------------------------------------------------------------------------

    async def _close(self, ok: bool) -> None:
        source, self.source = self.source, None
        if source is not None:
            self.proxy.end(source.role, self.route, source.worker, ok=ok)
            await source.response.aclose()

    async def _cleanup(self) -> None:
        if self._done:
            return
        self._done = True
        if not self._kv_handed:  # the client left first, or no decode took them
            assert self.kv_params is not None
            self.proxy.release_unspent(self.route, self.kv_params)
        source, self.source = self.source, None
        clock, metrics = self.clock, self.proxy.metrics
        # Bookkeeping first: the await below may be interrupted by cancellation.
        if source is not None:  # the client left mid-stream
            source.feed.stop()
            self.proxy.end(source.role, self.route, source.worker, ok=True)
        clock.mark("done")
        gaps = self._watch.gaps
        clock.tpot_s = sum(gaps) / len(gaps) if gaps else None
        metrics.requests.labels(endpoint=self.endpoint.name, status=str(self.status),
                                model_name=self.route.model).inc()
        metrics.request_duration.labels(endpoint=self.endpoint.name,
                                        model_name=self.route.model).observe(
            clock.mono["done"] - clock.started)
        self.proxy._account(clock, self.route.model, self._watch.usage, self._watch)
        self.proxy.on_done(clock, self.status)
        if source is not None:
            await source.response.aclose()


def _median(values: list[float]) -> float:
    """The median of ``values`` (not empty), as ``statistics.median`` gives it."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
