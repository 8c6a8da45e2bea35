"""Per-step metadata the scheduler half sends to the worker half (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvtransfer.protocol import RemotePrefill


@dataclass(frozen=True)
class PullSpec:
    """Decode side: pull ``remote``'s blocks into ``local_block_ids`` (tail-aligned)."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote: RemotePrefill


@dataclass
class PdserveMetadata(KVConnectorMetadata):
    """What the worker half must do this step."""

    pulls: list[PullSpec] = field(default_factory=list)
    """Decode: requests whose blocks are allocated and must be pulled."""
    releases: list[RemotePrefill] = field(default_factory=list)
    """Decode: leases to end without reading (full local prefix hit, or aborted before pull)."""
    leases: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Prefill: new leases, request id -> (expiry on the monotonic clock, lease token)."""
    renewals: list[RemotePrefill] = field(default_factory=list)
    """Decode: leases to extend because their requests still wait in this engine's queue."""


@dataclass(frozen=True)
class PdserveHandshakeMetadata(KVConnectorHandshakeMetadata):
    """The worker half's handshake, relayed by vLLM to the scheduler half."""

    wire: str
