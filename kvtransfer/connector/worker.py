"""Worker half of the pdserve connector: registers the paged KV cache and pulls blocks.

Runs in each vLLM worker process. On a prefill engine it serves leases: a responder thread
answers decode release messages while the engine keeps stepping. On a decode engine it reads
remote blocks with one-sided reads straight into the local paged KV cache, then releases the
lease; a read counts only if the release is answered "ok" (see ``kvtransfer.leases``). The
transport (``ConnectorConfig.transport``: UCX or NIXL, ``kvtransfer.transport.base``) only
moves bytes and messages; leases, expiry and the recompute fallback are the same on both.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer.blocks import build_read_ops, coalesce_runs
from kvtransfer.config import ConnectorConfig
from kvtransfer.connector.metadata import PdserveMetadata, PullSpec
from kvtransfer.connector.responder import LeaseResponder
from kvtransfer.errors import HandshakeError, KVTransferError
from kvtransfer.leases import LeaseTable
from kvtransfer.protocol import (
    RELEASE_EXPIRED,
    RELEASE_OK,
    Handshake,
    RegionSpec,
    RemotePrefill,
    compat_hash,
    release_message,
    renew_message,
)
from kvtransfer.regions import register_kv_caches
from kvtransfer.stats import CONTROL_COUNTERS, TransferStats

if TYPE_CHECKING:
    from kvtransfer.transport.base import Link, Pending, Transport

logger = logging.getLogger(__name__)


class _Phase(enum.Enum):
    READ = "read"
    RELEASE = "release"


@dataclass
class _Pull:
    spec: PullSpec
    peer: Link
    transfer: Pending
    phase: _Phase
    deadline: float
    started: float
    nbytes: int


@dataclass
class _PeerState:
    peer: Link
    handshake: Handshake
    rkeys: list[int]
    last_used: float = 0.0


PEER_IDLE_S = 120.0
"""A prefill engine not pulled from for this long (a restarted prefill has a new engine id, so
its old endpoint is never used again) is disconnected; a later pull reconnects. Not while it
still asks this engine for releases (two flex engines pull from each other): UCX pairs our
endpoint to it with its endpoint to us, and aborting ours broke its requests to us until UCX
reported the connection reset, 8 s later on the 2-core box (its pulls were then recomputed)."""
ASKERS_MAX = 4096
"""Requesters whose last request time is remembered (older ones are forgotten first)."""


class WorkerHalf:
    """Worker-side state of one engine: transport, regions, leases and pulls in flight."""

    def __init__(self, engine_id: str, config: ConnectorConfig, compat_facts: dict[str, object],
                 num_blocks: int) -> None:
        self.engine_id = engine_id
        self.block_size = int(compat_facts.get("block_size") or 0)  # type: ignore[call-overload]
        self.config = config
        self.num_blocks = num_blocks
        self._compat_facts = compat_facts
        self.leases = LeaseTable(memory_s=max(600.0, 10 * config.lease_s))
        self.stats = TransferStats()
        self._engine: Transport | None = None
        self._regions: list[RegionSpec] = []
        self._tensors: list[tuple[torch.Tensor, int]] = []
        self._handshake: Handshake | None = None
        self._peers: dict[str, _PeerState] = {}
        self._pulls: dict[str, _Pull] = {}
        self._releases: list[tuple[Pending, float]] = []
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._stop = threading.Event()
        self._responder: threading.Thread | None = None
        # pulls advance on a thread of their own as well as at each step (``_drive_pulls``);
        # the lock guards every piece of pull, peer and release state the two share
        self._lock = threading.RLock()
        self._pulls_started = threading.Event()
        self._driver: threading.Thread | None = None
        self._pulled_meta: PdserveMetadata | None = None
        self._reported_leases = (0, 0, 0, 0)
        self._reported_control: dict[str, int] = {}  # CONTROL_COUNTERS key -> last reported
        self._next_prune = 0.0
        self.peer_idle_s = max(PEER_IDLE_S, 2 * config.lease_s)
        """Seconds a peer may go unused, both ways, before it is disconnected."""
        self._asked_at: dict[bytes, float] = {}
        """Requester address (a UCX worker address) -> when it last sent us a request."""

    # ---------------------------------------------------------------- setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register every KV tensor once and start answering release messages."""
        from kvtransfer.transport.factory import open_transport

        # A transport without its own progress thread (nixl) serves remote reads promptly
        # only while a lease is active: no lease, no reader.
        self._engine = open_transport(self.config, label=f"pdserve-{self.engine_id[:8]}",
                                      reads_expected=lambda: self.leases.num_active > 0)
        registered = register_kv_caches(self._engine, kv_caches, self.num_blocks)
        self._tensors.extend(registered.tensors)
        self._regions = regions = list(registered.regions)
        # The transport is part of compatibility: a UCX decode cannot read a NIXL prefill.
        compat = compat_hash(**self._compat_facts, transport=self.config.transport,
                             regions=[(r.name, r.block_bytes) for r in regions])
        self._handshake = Handshake(self.engine_id, self._engine.address, tuple(regions), compat,
                                    self._engine.locality)
        self._responder = threading.Thread(target=self._serve_releases, daemon=True,
                                           name="pdserve-kv-releases")
        self._responder.start()
        self._driver = threading.Thread(target=self._drive_pulls, daemon=True,
                                        name="pdserve-kv-pulls")
        self._driver.start()
        logger.info("registered %d KV regions (%d blocks of %d bytes) with %s", len(regions),
                    self.num_blocks, regions[0].block_bytes if regions else 0,
                    self.config.transport)

    @property
    def handshake(self) -> Handshake | None:
        """Our handshake once the KV cache is registered."""
        return self._handshake

    # ---------------------------------------------------------------- prefill side
    def _serve_releases(self) -> None:
        assert self._engine is not None
        responder = LeaseResponder(self.leases, self.config.lease_s)
        while not self._stop.is_set():
            try:
                incoming = self._engine.poll_requests()
            except KVTransferError:
                logger.exception("release responder stopped")
                return
            responder.answer_granted()
            if not incoming:
                # blocks in C with the GIL released; a grant does not wake it, so look again
                # soon while a recent early release waits for one
                soon = responder.expects_grant(time.monotonic())
                self._engine.wait_requests(0.002 if soon else 0.05)
                continue
            self._saw_askers(incoming, time.monotonic())
            # the lease_released stamps wait in the table (take_stats): kept there with the
            # release itself, they reach the step that frees the blocks, which may be the
            # engine's last step for a while
            responder.answer(incoming)

    def _saw_askers(self, incoming: Sequence[Any], now: float) -> None:
        """Remember when each requester that names its address (UCX) last asked us."""
        for request in incoming:
            sender = getattr(request, "sender", None)
            if isinstance(sender, bytes):
                self._asked_at[sender] = now
        if len(self._asked_at) > ASKERS_MAX:
            newest = sorted(self._asked_at.items(), key=lambda kv: kv[1])[-ASKERS_MAX // 2:]
            self._asked_at = dict(newest)

    # ---------------------------------------------------------------- decode side
    def _drive_pulls(self) -> None:
        """Advance pulls between the engine's steps: a read that lands sends its release at
        once, and an answered release is ready for the step's ``poll``. Stepped only from
        ``poll``, a pull took three forwards to report (its read seen at the end of one, the
        release answered at the end of the next), which on a flex engine running 200-300 ms
        prefill forwards put most of a second into the handoff. Checks every 0.2 ms while a
        pull is young, backing off to 5 ms; sleeps while there is none."""
        while not self._stop.is_set():
            if not self._pulls:
                self._pulls_started.wait(0.5)
                self._pulls_started.clear()
                continue
            with self._lock:
                now = time.monotonic()
                self._advance_pulls(now)
                youngest = min((now - p.started for p in self._pulls.values()), default=0.0)
            time.sleep(min(max(youngest / 10, 0.0002), 0.005))

    # ---------------------------------------------------------------- per step
    def begin_step(self, meta: PdserveMetadata) -> None:
        """Grant this step's leases, send its releases and renewals and start its pulls: called
        when the step's metadata is bound (vLLM binds it before every forward; on CPU it calls
        ``start_load_kv`` only after the forward), so neither a decode's release nor a pull
        into its freshly allocated blocks (no forward reads them) waits for a forward pass."""
        with self._lock:
            self._take_messages(meta)
            for spec in meta.pulls:
                self._start_pull(spec)
            self._pulled_meta = meta  # ``start_step`` of the same step starts nothing again

    def _take_messages(self, meta: PdserveMetadata) -> None:
        for request_id, (expires_at, token) in meta.leases.items():
            now = time.monotonic()
            logger.debug("lease %s granted for %.1f s", request_id, expires_at - now)
            self.leases.grant(request_id, expires_at, token, now)
            self.stats.record_event(request_id, "lease_granted")
        for remote in meta.releases:
            self._send_release_only(remote)
        for remote in meta.renewals:
            self._send_renewal(remote)

    def start_step(self, meta: PdserveMetadata) -> None:
        """Start this step's pulls unless binding did (its lease messages were taken then)."""
        with self._lock:
            if meta is self._pulled_meta:
                return
            for spec in meta.pulls:
                self._start_pull(spec)

    def _peer(self, remote: RemotePrefill) -> _PeerState:
        state = self._peers.get(remote.engine_id)
        if state is not None and not state.peer.failed:
            state.last_used = time.monotonic()
            return state
        assert self._engine is not None and self._handshake is not None
        hs = Handshake.from_wire(remote.handshake_wire)
        if hs.engine_id != remote.engine_id:
            raise HandshakeError(f"handshake of engine {hs.engine_id} sent for engine "
                                 f"{remote.engine_id}")
        if hs.compat != self._handshake.compat or len(hs.regions) != len(self._regions):
            raise HandshakeError(f"engine {hs.engine_id} is incompatible (compat {hs.compat} "
                                 f"!= {self._handshake.compat})")
        peer = self._engine.connect(hs.ucx_address, hs.locality or None)
        rkeys = [peer.unpack_rkey(r.rkey, base=r.base, length=r.num_blocks * r.block_stride)
                 for r in hs.regions]
        state = _PeerState(peer, hs, rkeys, time.monotonic())
        logger.info("connected to engine %s over %s%s", hs.engine_id, peer.path,
                    f" ({peer.path_reason})" if peer.path_reason else "")
        self._peers[remote.engine_id] = state
        return state

    def _start_pull(self, spec: PullSpec) -> None:
        now = time.monotonic()
        local = spec.local_block_ids
        try:
            if not spec.remote.lease_token:
                raise KVTransferError("the params carry no lease token")
            if len(local) > len(spec.remote.block_ids):
                raise KVTransferError(f"{len(local)} local blocks for "
                                      f"{len(spec.remote.block_ids)} remote blocks")
            state = self._peer(spec.remote)
            remote_blocks = spec.remote.block_ids
            if spec.remote.num_tokens is not None and self.block_size:
                # only the blocks holding the prefill's computed tokens (never a spare one)
                remote_blocks = remote_blocks[:-(-spec.remote.num_tokens // self.block_size)]
            remote_ids = remote_blocks[len(remote_blocks) - len(local):]
            runs = coalesce_runs(local, remote_ids)
            ops = build_read_ops(runs, self._regions, state.handshake.regions, state.rkeys)
            transfer = state.peer.get(ops)
        except Exception as exc:  # any failure becomes a load error, never silent garbage
            logger.warning("pull of %s failed to start: %s", spec.request_id, exc)
            self._fail(spec, str(exc))
            return
        nbytes = int(ops[:, 2].sum()) if len(ops) else 0
        self.stats.record_event(spec.request_id, "pull_started")
        self._pulls[spec.request_id] = _Pull(spec, state.peer, transfer, _Phase.READ,
                                             now + self.config.pull_timeout_s, now, nbytes)
        self._pulls_started.set()

    def _send_release_only(self, remote: RemotePrefill) -> None:
        try:
            state = self._peer(remote)
            transfer = state.peer.request(release_message(remote.request_id,
                                                                remote.lease_token))
        except Exception as exc:
            logger.warning("could not release lease %s: %s (it will expire)",
                           remote.request_id, exc)
            return
        self._releases.append((transfer, time.monotonic() + self.config.pull_timeout_s))

    def _send_renewal(self, remote: RemotePrefill) -> None:
        """Extend a lease whose request still waits in our queue (answer not needed: if it
        expired anyway, the pull fails and vLLM recomputes)."""
        try:
            transfer = self._peer(remote).peer.request(renew_message(remote.request_id,
                                                                      remote.lease_token))
        except Exception as exc:
            logger.warning("could not renew lease %s: %s", remote.request_id, exc)
            return
        self._releases.append((transfer, time.monotonic() + self.config.pull_timeout_s))

    def _fail(self, spec: PullSpec, reason: str) -> None:
        logger.warning("pull of %s failed (%s); its %d blocks are recomputed", spec.request_id,
                       reason, len(spec.local_block_ids))
        self._load_errors.update(spec.local_block_ids)
        self._finished_recving.add(spec.request_id)
        self.stats.record_failure(reason)

    def _corruption_on(self) -> bool:
        path = self.config.corrupt_pulled_kv_file
        return bool(path) and os.path.exists(path)  # type: ignore[arg-type]

    def _corrupt(self, block_ids: tuple[int, ...]) -> None:
        """Negative control: overwrite pulled blocks with noise (test-only switch)."""
        gen = torch.Generator().manual_seed(1234)
        index = torch.tensor(block_ids, dtype=torch.long)
        for tensor, dim in self._tensors:
            noise = torch.randn(tensor.index_select(dim, index).shape, generator=gen)
            tensor.index_copy_(dim, index, noise.to(tensor.dtype))

    def _abort(self, request_id: str, pull: _Pull, now: float) -> bool:
        """Abort ``pull``'s peer (every read on it stops; it is reconnected on next use);
        False when the abort failed: reads may still land, so the blocks stay withheld from
        vLLM and the abort is tried again after ``pull_timeout_s``."""
        try:
            pull.peer.abort()
        except Exception as exc:  # the engine must not die of it
            logger.error("abort of the pull of %s failed (%s); retrying in %.0f s",
                         request_id, exc, self.config.pull_timeout_s)
            pull.deadline = now + self.config.pull_timeout_s
            return False
        self._peers = {k: v for k, v in self._peers.items() if v.peer is not pull.peer}
        return True

    def poll(self) -> tuple[set[str], set[str]]:
        """Advance pulls and leases; returns (finished sending, finished receiving)."""
        with self._lock:
            now = time.monotonic()
            self._advance_pulls(now)
            self._releases = [(t, d) for t, d in self._releases
                              if t.poll() == "pending" and now <= d]
            self.leases.expire(now)
            if now >= self._next_prune:
                self._prune_peers(now)
            finished_sending = self.leases.take_finished()
            finished_recving, self._finished_recving = self._finished_recving, set()
        return finished_sending, finished_recving

    def _advance_pulls(self, now: float) -> None:
        """Move every pull on: read landed -> release sent -> release answered (or failed)."""
        for request_id, pull in list(self._pulls.items()):
            status = pull.transfer.poll()
            timed_out = status == "pending" and now > pull.deadline
            # A failed read may still have GETs in flight (a batch failed part-way, or the
            # control endpoint failed while data still flows): quiesce them before vLLM may
            # recompute into those blocks (security review finding 16), as after a timeout.
            if timed_out or (status == "error" and pull.phase is _Phase.READ):
                if not self._abort(request_id, pull, now):
                    continue
                del self._pulls[request_id]
                self._fail(pull.spec, f"timeout in {pull.phase.value} after "
                                      f"{self.config.pull_timeout_s} s" if timed_out else
                           f"{pull.phase.value}: {pull.transfer.error}")
                continue
            if status == "error":
                del self._pulls[request_id]
                self._fail(pull.spec, f"{pull.phase.value}: {pull.transfer.error}")
                continue
            if status != "done":
                continue
            if pull.phase is _Phase.READ:
                logger.debug("read of %s done after %.2f ms", request_id,
                             1e3 * (now - pull.started))
                self.stats.record_event(request_id, "read_done")
                if self._corruption_on() and pull.spec.local_block_ids:
                    self._corrupt(pull.spec.local_block_ids)
                try:
                    pull.transfer = pull.peer.request(release_message(
                        pull.spec.remote.request_id, pull.spec.remote.lease_token))
                except (KVTransferError, ValueError) as exc:
                    del self._pulls[request_id]
                    self._fail(pull.spec, f"release: {exc}")
                    continue
                pull.phase = _Phase.RELEASE
                continue
            del self._pulls[request_id]
            reply = pull.transfer.result()
            if reply == RELEASE_OK:
                self.stats.record_event(request_id, "release_answered")
                self._finished_recving.add(request_id)
                self.stats.record_pull(pull.nbytes, len(pull.spec.local_block_ids),
                                       time.monotonic() - pull.started,
                                       same_host=pull.peer.path == "pvm")
            else:
                self._fail(pull.spec, "lease expired before the pull finished"
                           if reply == RELEASE_EXPIRED else f"bad release reply {reply!r}")

    def _prune_peers(self, now: float) -> None:
        """Disconnect peers idle past ``peer_idle_s`` both ways (gone or restarted prefill
        engines, :data:`PEER_IDLE_S`) or failed, unless a pull still uses them."""
        self._next_prune = now + 10.0
        busy = {id(p.peer) for p in self._pulls.values()}
        for engine_id, state in list(self._peers.items()):
            asked = self._asked_at.get(state.handshake.ucx_address, -math.inf)
            idle = now - max(state.last_used, asked) > self.peer_idle_s
            if (idle or state.peer.failed) and id(state.peer) not in busy:
                del self._peers[engine_id]
                with contextlib.suppress(Exception):
                    state.peer.abort()
                logger.info("disconnected from engine %s (%s)", engine_id,
                            "failed" if state.peer.failed else "idle")

    def take_load_errors(self) -> set[int]:
        """Local blocks whose pull failed since the last call (vLLM recomputes them)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> TransferStats | None:
        """Telemetry since the last call, or None when nothing happened."""
        with self._lock:
            return self._take_stats()

    def _take_stats(self) -> TransferStats | None:
        released, expired = self.leases.num_released, self.leases.num_expired
        renewed, refused = self.leases.num_renewed, self.leases.num_refused
        last_released, last_expired, last_renewed, last_refused = self._reported_leases
        self.stats.record_leases(released - last_released, expired - last_expired,
                                 renewed - last_renewed, refused - last_refused)
        self._reported_leases = (released, expired, renewed, refused)
        engine = self._engine
        for key, (attr, _) in CONTROL_COUNTERS.items():
            now = int(getattr(engine, attr, 0)) if engine is not None else 0
            if now > self._reported_control.get(key, 0):
                self.stats.record_control(key, now - self._reported_control.get(key, 0))
                self._reported_control[key] = now
        for request_id, at in self.leases.take_released():
            self.stats.record_event(request_id, "lease_released", at)
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, TransferStats()
        return stats

    def shutdown(self) -> None:
        """Stop the responder and the pull driver and release the transport's resources."""
        self._stop.set()
        self._pulls_started.set()
        for thread in (self._responder, self._driver):
            if thread is not None:
                thread.join(timeout=2)
        if self._engine is not None:
            self._engine.close()
            self._engine = None
