"""Follow the prefill engines' KV cache events (``--kv-events``) and feed the placement pools.

A worker started with ``pdserve worker --kv-events-port N`` has vLLM publish its KV cache events
on ZMQ (``tcp://*:N``) and advertises ``tcp://HOST:N`` in its registry record
(``WorkerRecord.kv_events_endpoint``). :class:`KVEventSubscriber` keeps one SUB socket (all
topics) per prefill or aggregated worker that advertises one, connected while the worker is in
the membership view, decodes each batch (:mod:`router.state.kv_wire`), translates it into the
router's hash space (one :class:`~router.policy.kv_events.KVEventTranslator` per worker) and
hands each resulting :class:`~router.policy.base.CacheChanged` to ``deliver(role, change)``.

zmq is imported here only; this module is imported only when ``--kv-events`` is on. Events
published before the router connected are not replayed: blocks stored then stay known only by
the router's own dispatch estimate, and their descendants' ``BlockStored`` are orphans.

Gaps. Each batch carries a sequence number. When one is skipped (the SUB queue overflowed, the
connection dropped and came back), a lost ``BlockRemoved`` would leave the router believing the
engine caches blocks it evicted, and send it prompts for them. So before the batch after the
gap is applied, the missed batches are asked for on the worker's replay socket (vLLM's
``replay_endpoint``, advertised as ``WorkerRecord.kv_events_replay_endpoint``) and applied in
order. When the worker has none, the replay does not answer within ``REPLAY_TIMEOUT_S``, or its
buffer no longer holds them all, the router forgets that engine's cache view
(``cleared``) and rebuilds it from later events and its own dispatches: fewer hits, never a
stale one. Counted as ``gap``, ``replayed`` (batches) and ``resync_cleared``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from router.errors import ConfigError
from router.policy.base import CacheChanged
from router.policy.kv_events import KVEventTranslator
from router.state.cluster import ClusterSource, cancel_task
from router.state.kv_wire import KVEventsDecodeError, decode_batch, kind, translate
from router.state.registry import WorkerRecord

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 2**20
"""Largest KV event batch accepted (vLLM's batches are kilobytes)."""
RECEIVE_QUEUE = 10_000
"""Messages a SUB socket queues before newer ones are dropped (a gap, recovered below)."""
REPLAY_TIMEOUT_S = 2.0
"""How long a replay may take to answer each message before the router gives up on it."""
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

ROLES = ("prefill", "aggregated", "flex")
"""Roles whose engines' caches the prefill policies model."""


@dataclass
class _Followed:
    record: WorkerRecord
    translator: KVEventTranslator
    task: asyncio.Task[None] | None = None
    counts: dict[str, int] = field(default_factory=dict)
    last_seq: int = -1


class KVEventSubscriber:
    """One SUB socket per followed worker; membership re-read every ``interval_s``.

    ``on_event(kind)`` counts each event (``stored``, ``removed``, ``cleared``) and each
    anomaly (``orphan``: a stored block whose parent is unknown, ignored; ``gap``: a batch
    sequence number skipped; ``replayed``: a missed batch applied from the worker's replay
    socket; ``resync_cleared``: a gap that could not be replayed, the engine's view forgotten;
    ``undecodable``; ``refused``: the engine's block size is not a multiple of ours, the worker
    is no longer followed)."""

    def __init__(self, cluster: ClusterSource, deliver: Callable[[str, CacheChanged], None],
                 on_event: Callable[[str], None] = lambda kind: None, *,
                 block_tokens: int = 16, interval_s: float = 1.0) -> None:
        self._cluster = cluster
        self._deliver = deliver
        self._on_event = on_event
        self._block_tokens = block_tokens
        self._interval_s = interval_s
        self._ctx: zmq.asyncio.Context | None = None
        self._followed: dict[str, _Followed] = {}
        self._task: asyncio.Task[None] | None = None

    def sync(self) -> None:
        """Follow the live prefill/aggregated workers that advertise an endpoint; stop
        following the others."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        wanted = {r.worker_id: r for r in self._cluster.workers()
                  if r.role in ROLES and r.kv_events_endpoint}
        for wid in [w for w in self._followed if w not in wanted]:
            task = self._followed.pop(wid).task
            if task is not None:
                task.cancel()
            logger.info("stopped following the KV events of %s", wid)
        for wid, record in wanted.items():
            if wid not in self._followed:
                followed = _Followed(record, KVEventTranslator(wid, self._block_tokens))
                followed.task = asyncio.create_task(self._follow(followed),
                                                    name=f"pdserve-kv-events-{wid}")
                self._followed[wid] = followed

    async def _follow(self, followed: _Followed) -> None:
        record = followed.record
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        # a publisher is trusted with nothing: one frame over MAX_MESSAGE_BYTES drops the
        # connection, and at most RECEIVE_QUEUE messages wait (security review finding 9)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sock.connect(record.kv_events_endpoint)
        logger.info("following the KV events of %s at %s", record.worker_id,
                    record.kv_events_endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                seq = _sequence(frames)
                if seq is not None:
                    if 0 <= followed.last_seq < seq - 1 \
                            and not await self._recover(followed, seq):
                        return
                    followed.last_seq = seq
                if not self._handle(followed, frames):
                    return
        finally:
            sock.close(linger=0)

    async def _recover(self, followed: _Followed, upto: int) -> bool:
        """Batches ``last_seq + 1 .. upto - 1`` were lost: apply them from the replay socket, or
        forget the engine's cache view. False when the worker cannot be followed."""
        wid = followed.record.worker_id
        first = followed.last_seq + 1
        self._count(followed, "gap")
        replayed = await self._replay(followed, first, upto)
        if replayed is None:
            logger.warning("KV events of %s: batches %d..%d were lost and cannot be replayed; "
                           "forgetting its cache view", wid, first, upto - 1)
            self._count(followed, "resync_cleared")
            self._deliver(followed.record.role, followed.translator.cleared())
            return True
        logger.info("KV events of %s: batches %d..%d were lost, replayed", wid, first, upto - 1)
        for frames in replayed:
            self._count(followed, "replayed")
            if not self._handle(followed, frames):
                return False
        return True

    async def _replay(self, followed: _Followed, first: int, upto: int
                      ) -> list[list[bytes]] | None:
        """Batches ``first .. upto - 1`` from the worker's replay socket, in order; None when
        it has none, is silent, or no longer holds them all."""
        endpoint = followed.record.kv_events_replay_endpoint
        if not endpoint or self._ctx is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            batches: list[list[bytes]] = []
            expected = first
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    return None
                frames = (await sock.recv_multipart())[1:]  # the empty delimiter first
                if len(frames) >= 2 and frames[-2] == _END_OF_REPLAY:
                    return batches if expected >= upto else None
                seq = _sequence(frames)
                if seq is None or seq >= upto:
                    continue
                if seq != expected:  # the buffer rolled past what we missed
                    return None
                batches.append(frames)
                expected += 1
        finally:
            sock.close(linger=0)

    def _count(self, followed: _Followed, what: str) -> None:
        followed.counts[what] = followed.counts.get(what, 0) + 1
        self._on_event(what)

    def _handle(self, followed: _Followed, frames: list[bytes]) -> bool:
        """Apply one message; False when the worker cannot be followed."""
        wid = followed.record.worker_id
        try:
            batch = decode_batch(frames[-1])
        except KVEventsDecodeError as exc:
            self._count(followed, "undecodable")
            logger.warning("KV events of %s: %s", wid, exc)
            return True
        translator = followed.translator
        for event in batch.events:
            orphans = translator.orphans
            try:
                change = translate(translator, event)
            except ConfigError as exc:
                self._count(followed, "refused")
                logger.error("%s", exc)
                return False
            self._count(followed, "orphan" if translator.orphans > orphans else kind(event))
            if change is not None:
                self._deliver(followed.record.role, change)
        return True

    def stats(self, worker_id: str) -> dict[str, Any] | None:
        """What the events of ``worker_id`` said so far (None when not followed)."""
        followed = self._followed.get(worker_id)
        if followed is None:
            return None
        t = followed.translator
        return {"endpoint": followed.record.kv_events_endpoint, "events": dict(followed.counts),
                "live_blocks": t.live_blocks, "live_hashes": t.live_hashes,
                "engine_block_tokens": t.engine_block_tokens}

    async def _loop(self) -> None:
        while True:
            try:
                self.sync()
            except Exception:  # a bad record must not end the subscription of the others
                logger.exception("cannot update the KV event subscriptions")
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        """Start following in the background (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pdserve-kv-events")

    async def close(self) -> None:
        await cancel_task(self._task)
        self._task = None
        for followed in self._followed.values():
            await cancel_task(followed.task)
        self._followed.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # also closes a socket whose cancelled task has not run
            self._ctx = None


def _sequence(frames: list[bytes]) -> int | None:
    """A batch's sequence number (vLLM's second-to-last frame), None when it has none."""
    if len(frames) >= 2 and len(frames[-2]) == 8:
        return int.from_bytes(frames[-2], "big")
    return None
