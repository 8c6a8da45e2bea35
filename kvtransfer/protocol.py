"""Wire formats: the per-engine handshake and the per-request ``kv_transfer_params``.

A prefill engine's handshake says where its paged KV cache lives (UCX worker address, one
region per KV tensor with packed rkeys and block geometry). It travels inside the
``kv_transfer_params`` a prefill returns, so the router stays a dumb relay and a decode worker
needs no side channel; decode caches the unpacked peer per ``engine_id``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import HandshakeError

PROTOCOL_VERSION = 1

# Keys of kv_transfer_params (vLLM's own names where NixlConnector has one).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_HANDSHAKE = "remote_handshake"
REMOTE_NUM_TOKENS = "remote_num_tokens"
"""Prompt tokens whose KV the prefill holds. A decode request may extend the prompt (the
router appends the token the prefill sampled, see ``router.api.first_token``); only this many
tokens are pulled, the rest are computed locally."""
REMOTE_LEASE_TOKEN = "remote_lease_token"
"""A random secret the prefill draws per lease; a release or renewal must echo it. It travels
only inside the router-signed params, so a peer that merely reaches the control channel (and
can guess request ids) cannot end or extend someone else's lease."""

# Release round trip: decode -> prefill "done <lease token> <request id>", prefill answers one
# of these. Renewal: decode -> prefill "renew <lease token> <request id>" while the request
# waits in the decode's queue (the lease is extended by its length, up to its life cap;
# "expired" when it is gone already). A lease is one-shot: a second release is "expired".
RELEASE_PREFIX = b"done "
RENEW_PREFIX = b"renew "
RELEASE_OK = b"ok"
RELEASE_EXPIRED = b"expired"


@dataclass(frozen=True)
class RegionSpec:
    """One registered KV tensor view: ``num_blocks`` blocks of ``block_bytes`` at ``base``."""

    name: str
    base: int
    block_stride: int
    block_bytes: int
    num_blocks: int
    rkey: bytes

    def block_addr(self, block_id: int) -> int:
        """Address of ``block_id`` in this region."""
        return self.base + block_id * self.block_stride


@dataclass(frozen=True)
class Handshake:
    """Everything a decode worker needs to read a prefill engine's blocks."""

    engine_id: str
    ucx_address: bytes
    regions: tuple[RegionSpec, ...]
    compat: str
    locality: bytes = b""
    """Same-host identity of the engine (empty: read over UCX only)."""

    def to_wire(self) -> str:
        """Compact ASCII form for JSON transport."""
        doc = {
            "v": PROTOCOL_VERSION,
            "e": self.engine_id,
            "a": base64.b64encode(self.ucx_address).decode(),
            "c": self.compat,
            "l": base64.b64encode(self.locality).decode(),
            "r": [[r.name, r.base, r.block_stride, r.block_bytes, r.num_blocks,
                   base64.b64encode(r.rkey).decode()] for r in self.regions],
        }
        return base64.b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode()

    @classmethod
    def from_wire(cls, wire: str) -> Handshake:
        """Parse ``to_wire`` output; raises HandshakeError when malformed or of another version."""
        try:
            doc = json.loads(base64.b64decode(wire, validate=True))
            if doc["v"] != PROTOCOL_VERSION:
                raise HandshakeError(f"handshake version {doc['v']} != {PROTOCOL_VERSION}")
            regions = tuple(
                RegionSpec(str(n), int(b), int(s), int(bb), int(nb), base64.b64decode(k))
                for n, b, s, bb, nb, k in doc["r"])
            return cls(str(doc["e"]), base64.b64decode(doc["a"]), regions, str(doc["c"]),
                       base64.b64decode(doc.get("l", "")))
        except HandshakeError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise HandshakeError(f"malformed handshake: {exc}") from exc


def compat_hash(**facts: Any) -> str:
    """Stable digest of what must match between prefill and decode (model, dtype, geometry)."""
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class RemotePrefill:
    """Parsed ``kv_transfer_params`` of a request that a decode worker must pull."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    handshake_wire: str
    num_tokens: int | None = None
    """Tokens the remote KV covers (None: the whole prompt, as older prefills sent)."""
    lease_token: str = ""
    """The lease's secret, echoed by the release and renewals (``REMOTE_LEASE_TOKEN``)."""

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """None unless ``params`` ask for a remote prefill and carry every field we need."""
        if not params or not params.get(DO_REMOTE_PREFILL):
            return None
        try:
            num_tokens = params.get(REMOTE_NUM_TOKENS)
            return cls(str(params[REMOTE_ENGINE_ID]), str(params[REMOTE_REQUEST_ID]),
                       tuple(int(b) for b in params[REMOTE_BLOCK_IDS]),
                       str(params[REMOTE_HANDSHAKE]),
                       None if num_tokens is None else int(num_tokens),
                       str(params.get(REMOTE_LEASE_TOKEN) or ""))
        except (KeyError, TypeError, ValueError):
            return None


def new_lease_token() -> str:
    """A fresh per-lease secret (128 random bits, URL-safe, no spaces)."""
    return secrets.token_urlsafe(16)


def release_message(request_id: str, lease_token: str) -> bytes:
    """The decode -> prefill message that ends a lease after a pull."""
    return RELEASE_PREFIX + _lease_ref(request_id, lease_token)


def parse_release(payload: bytes) -> tuple[str, str] | None:
    """(request id, lease token) of a release message, or None for anything else."""
    return _parse_lease_ref(payload, RELEASE_PREFIX)


def renew_message(request_id: str, lease_token: str) -> bytes:
    """The decode -> prefill message that extends a lease while the request is queued."""
    return RENEW_PREFIX + _lease_ref(request_id, lease_token)


def parse_renew(payload: bytes) -> tuple[str, str] | None:
    """(request id, lease token) of a renewal message, or None for anything else."""
    return _parse_lease_ref(payload, RENEW_PREFIX)


def _lease_ref(request_id: str, lease_token: str) -> bytes:
    if not lease_token or " " in lease_token:
        raise ValueError("a lease token is required and holds no space")
    return lease_token.encode() + b" " + request_id.encode()


def _parse_lease_ref(payload: bytes, prefix: bytes) -> tuple[str, str] | None:
    if not payload.startswith(prefix):
        return None
    token, sep, request_id = payload[len(prefix):].partition(b" ")
    if not sep or not token or not request_id:
        return None
    return request_id.decode(errors="replace"), token.decode(errors="replace")
