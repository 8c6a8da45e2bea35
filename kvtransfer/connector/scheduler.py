"""Scheduler half of the pdserve connector: decides what to pull, lease and release.

Runs in vLLM's engine-core process. It never touches KV memory or UCX; it turns scheduler
events into :class:`PdserveMetadata` for the worker half and into the ``kv_transfer_params``
a prefill returns.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvtransfer.config import ConnectorConfig
from kvtransfer.connector.metadata import PdserveHandshakeMetadata, PdserveMetadata, PullSpec
from kvtransfer.protocol import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    REMOTE_HANDSHAKE,
    REMOTE_LEASE_TOKEN,
    REMOTE_NUM_TOKENS,
    REMOTE_REQUEST_ID,
    Handshake,
    RemotePrefill,
    new_lease_token,
)
from kvtransfer.signing import REPLAYED, KeyringFile, SeenSignatures, current, verify_for_engine
from kvtransfer.stats import TransferStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerHalf:
    """Scheduler-side state of one engine (both roles: an engine may prefill and decode)."""

    def __init__(self, engine_id: str, config: ConnectorConfig) -> None:
        self.engine_id = engine_id
        self.config = config
        self.handshake_wire: str | None = None
        self._pulls: list[PullSpec] = []
        self._releases: list[RemotePrefill] = []
        self._leases: dict[str, tuple[float, str]] = {}
        self._awaiting_schedule: set[str] = set()
        # decode: requests that will pull but wait in the queue -> (remote, next renewal)
        self._queued: dict[str, tuple[RemotePrefill, float]] = {}
        self._renewals: list[RemotePrefill] = []
        self.stats = TransferStats()
        self._keyring = (KeyringFile(config.signing_keys_file) if config.signing_keys_file
                         else None)
        self._seen = SeenSignatures()

    def _authorized(self, request: Request, params: dict[str, Any]) -> bool:
        """With a keyring, only params the router signed for this engine, used once, may lease
        or pull; others are stripped (the request then runs as a plain one: no lease, no read)."""
        keyring = current(self._keyring)
        if keyring is None:
            return True
        why = verify_for_engine(keyring, params, time.time(), self.engine_id, self._seen,
                                self.config.signature_max_age_s)
        if why is None:
            return True
        if why == REPLAYED and getattr(request, "abort_immediately", False):
            # vLLM's API server gave up on a request whose client left (or that it rejected)
            # and submits its params again, pre-aborted, so the connector frees what it pinned.
            # The first submission was admitted and owns the lease: not an attack, not counted.
            logger.debug("request %s: vLLM's clean-up copy of an admitted request's params",
                         request.request_id)
        else:
            self.stats.record_refused()
            logger.warning("request %s: kv_transfer_params refused (%s); served without "
                           "transfer", request.request_id, why)
        params[DO_REMOTE_PREFILL] = False
        params[DO_REMOTE_DECODE] = False
        return False

    def on_new_request(self, request: Request) -> None:
        """Check the params' signature; timeline: a decode request that will pull, or a
        prefill that will lease, arrived. Params that are not a JSON object (vLLM lets
        ``vllm_xargs`` carry a string or a list there) are dropped: the request runs plain."""
        params = request.kv_transfer_params
        if params is not None and not isinstance(params, dict):
            logger.warning("request %s: kv_transfer_params of type %s dropped",
                           request.request_id, type(params).__name__)
            self.stats.record_refused()
            request.kv_transfer_params = None
            return
        if not params:
            return
        if (params.get(DO_REMOTE_PREFILL) or params.get(DO_REMOTE_DECODE)) and \
                not self._authorized(request, params):
            return
        if params.get(DO_REMOTE_PREFILL):
            self.stats.record_event(request.request_id, "remote_seen")
            remote = RemotePrefill.from_params(params)
            if remote is not None:
                self._queued[request.request_id] = (remote, self._next_renewal(params))
        elif params.get(DO_REMOTE_DECODE):
            self.stats.record_event(request.request_id, "admitted")
        else:
            return
        trace = {k: v for k, v in (request.trace_headers or {}).items()
                 if k.lower() in ("traceparent", "tracestate")}
        if trace:
            self.stats.record_trace(request.request_id, trace)

    def _next_renewal(self, params: dict[str, Any]) -> float:
        """When a queued request's lease is renewed next: a third of the prefill's lease."""
        try:
            lease_s = float(params.get("lease_s") or self.config.lease_s)
        except (TypeError, ValueError):
            lease_s = self.config.lease_s
        return time.monotonic() + max(lease_s, 0.3) / 3

    def on_connector_output(self, finished_recving: set[str] | None) -> None:
        """Timeline: vLLM learned that these pulls finished (success or load error)."""
        for request_id in finished_recving or ():
            if request_id in self._awaiting_schedule:
                self.stats.record_event(request_id, "finished_seen")

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """Keep rank 0's handshake for our responses and publish it for the launcher."""
        meta = metadata.get(0)
        if not isinstance(meta, PdserveHandshakeMetadata):
            logger.error("no pdserve handshake from worker rank 0: %r", meta)
            return
        self.handshake_wire = meta.wire
        if self.config.handshake_file:
            hs = Handshake.from_wire(meta.wire)
            doc = {"engine_id": self.engine_id, "handshake": meta.wire,
                   "ucx_address_bytes": len(hs.ucx_address), "regions": len(hs.regions)}
            tmp = f"{self.config.handshake_file}.tmp"
            with open(tmp, "w") as fh:
                json.dump(doc, fh)
            os.replace(tmp, self.config.handshake_file)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: every uncached prompt token the prefill holds comes from it, loaded
        asynchronously (a prompt extended past the prefill's is computed locally after)."""
        remote = RemotePrefill.from_params(request.kv_transfer_params)
        if remote is None:
            return 0, False
        held = len(request.prompt_token_ids or ())
        if remote.num_tokens is not None:
            held = min(held, remote.num_tokens)
        count = held - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Decode: schedule the pull into the freshly allocated (unhashed) blocks."""
        params = request.kv_transfer_params
        if not params or not params.get(DO_REMOTE_PREFILL):
            return
        self._queued.pop(request.request_id, None)  # allocated: it pulls (or releases) now
        remote = RemotePrefill.from_params(params)
        if remote is None:
            logger.warning("request %s: incomplete kv_transfer_params, prompt is recomputed",
                           request.request_id)
        elif num_external_tokens > 0:
            local = tuple(blocks.get_unhashed_block_ids())
            self._pulls.append(PullSpec(request.request_id, local, remote))
            self._awaiting_schedule.add(request.request_id)
        else:
            # Full local prefix hit: nothing to read, but the prefill must free its blocks.
            self._releases.append(remote)
        params[DO_REMOTE_PREFILL] = False  # one transfer per request

    def build_connector_meta(self, scheduled: Iterable[str] = ()) -> PdserveMetadata:
        """Hand this step's work to the worker half and reset; ``scheduled`` are the request
        ids vLLM computes in this step (a pulled request's first one ends its timeline)."""
        if self._awaiting_schedule:
            for request_id in scheduled:
                if request_id in self._awaiting_schedule:
                    self._awaiting_schedule.discard(request_id)
                    self.stats.record_event(request_id, "first_scheduled")
        if self._queued:
            now = time.monotonic()
            for request_id, (remote, due) in list(self._queued.items()):
                if due <= now:
                    self._renewals.append(remote)
                    interval = max(self.config.lease_s, 0.3) / 3
                    self._queued[request_id] = (remote, now + interval)
        meta = PdserveMetadata(pulls=self._pulls, releases=self._releases, leases=self._leases,
                               renewals=self._renewals)
        self._pulls, self._releases, self._leases, self._renewals = [], [], {}, []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: lease the blocks and describe them; decode: release unread leases."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        self._awaiting_schedule.discard(request.request_id)
        self._queued.pop(request.request_id, None)
        if params.get(DO_REMOTE_PREFILL):
            # Aborted before a pull was scheduled: the prefill's blocks must not be stranded.
            remote = RemotePrefill.from_params(params)
            if remote is not None:
                self._releases.append(remote)
            params[DO_REMOTE_PREFILL] = False
            return False, None
        if not params.get(DO_REMOTE_DECODE):
            return False, None
        finished_ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                         RequestStatus.FINISHED_STOPPED)
        if not finished_ok or not block_ids:
            return False, None
        if self.handshake_wire is None:
            logger.error("request %s: no transport handshake yet, blocks freed", request.request_id)
            return False, None
        token = new_lease_token()
        self._leases[request.request_id] = (time.monotonic() + self.config.lease_s, token)
        self.stats.record_event(request.request_id, "prefill_done")
        return True, {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            REMOTE_ENGINE_ID: self.engine_id,
            REMOTE_REQUEST_ID: request.request_id,
            REMOTE_BLOCK_IDS: list(block_ids),
            REMOTE_HANDSHAKE: self.handshake_wire,
            REMOTE_NUM_TOKENS: min(request.num_computed_tokens, request.num_prompt_tokens),
            REMOTE_LEASE_TOKEN: token,
            "lease_s": self.config.lease_s,
        }

    def take_stats(self) -> TransferStats | None:
        """Timeline events since the last call, or None."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, TransferStats()
        return stats
