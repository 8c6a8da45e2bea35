"""Worker registry in Redis: one key per worker with a TTL, join/leave events on a channel.

Keys: ``{prefix}:worker:{worker_id}`` -> ``WorkerRecord.to_json()`` with a TTL of ``ttl_s``;
events: ``{prefix}:events`` gets ``{"type": "join"|"leave", "worker_id", "role", "model"}``.
A worker that stops heartbeating disappears from the registry within ``ttl_s``; a worker that
deregisters leaves a short-lived tombstone ``{prefix}:left:{worker_id}`` so routers can tell a
deliberate exit from a missed heartbeat (``router.state.cluster`` keeps a worker whose key
expired while it still answers).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.errors import RegistryError

if TYPE_CHECKING:
    from kvtransfer.signing import Keyring

logger = logging.getLogger(__name__)

RECORD_DOMAIN = b"pdserve-worker-record"
"""Separates a registration's signature from every other use of the cluster secret."""

TOMBSTONE_MS = 300_000
"""How long a deregistered worker's tombstone lives."""

ROLES = ("prefill", "decode", "aggregated", "flex")
"""``aggregated``: a plain vLLM server that serves whole requests (no KV connector); ``flex``: an
engine with the connector that the router uses, request by request, whole, as a prefill or as a
decode (adaptive disaggregation, ``router.policy.adaptive``)."""


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker tells the cluster about itself."""

    worker_id: str
    role: Literal["prefill", "decode", "aggregated", "flex"]
    model: str
    """Served model name (what clients put in ``model``)."""
    model_path: str
    """Local directory of weights and tokenizer; the router loads the tokenizer from it."""
    http_url: str
    """Base URL of the worker's OpenAI server, e.g. ``http://127.0.0.1:8101``."""
    engine_id: str
    ucx_address: str
    """Base64 UCX worker address; informational."""
    max_model_len: int
    started_at: float
    kv_events_endpoint: str = ""
    """ZMQ endpoint of the engine's KV cache events (``tcp://HOST:PORT``; ``pdserve worker
    --kv-events-port``), empty when it publishes none."""
    kv_events_replay_endpoint: str = ""
    """ZMQ endpoint of the engine's KV event replay socket (``pdserve worker
    --kv-events-replay-port``): a router that misses batches asks it for them."""
    signature: str = ""
    """HMAC of every other field under the cluster secret (`signed`): routers with a keyring
    ignore records without a valid one, so Redis access alone cannot register a worker."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def _signed_text(self) -> bytes:
        return replace(self, signature="").to_json().encode()

    def signed(self, keyring: Keyring) -> WorkerRecord:
        """This record carrying the cluster's signature over all its other fields."""
        return replace(self, signature=keyring.mac(RECORD_DOMAIN, self._signed_text()))

    def verified(self, keyring: Keyring) -> bool:
        """Whether a holder of the cluster secret wrote exactly this record."""
        return bool(self.signature) and keyring.verify_mac(RECORD_DOMAIN, self._signed_text(),
                                                           self.signature)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        data: dict[str, Any] = json.loads(raw)
        known = {f.name for f in fields(cls)}
        # Unknown keys are dropped so that newer workers can add fields without breaking routers.
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["max_model_len"] = int(kwargs["max_model_len"])
        kwargs["started_at"] = float(kwargs["started_at"])
        return cls(**kwargs)


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs)."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if not parsed.password:
        return url
    netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
    return parsed._replace(netloc=netloc).geturl()


class WorkerRegistry:
    """Async client of the registry; every Redis failure is raised as :class:`RegistryError`."""

    def __init__(self, redis_url: str, *, prefix: str = "pdserve", ttl_s: float = 10.0,
                 trust: Callable[[WorkerRecord], bool] | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.trust = trust
        """When set, `list` leaves out every record it refuses (a router with a keyring:
        `WorkerRecord.verified`), logging each refused worker id once."""
        self._refused: set[str] = set()
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.events_channel = f"{prefix}:events"
        self._redis = aioredis.from_url(
            redis_url,
            socket_connect_timeout=1.0,
            socket_timeout=2.0,
            health_check_interval=0,
        )

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def _publish(self, kind: str, worker_id: str, role: str = "", model: str = "") -> None:
        event = {"type": kind, "worker_id": worker_id, "role": role, "model": model}
        await self._redis.publish(self.events_channel, json.dumps(event))

    async def register(self, record: WorkerRecord) -> None:
        try:
            await self._redis.set(self._key(record.worker_id), record.to_json(), px=self._ttl_ms)
            await self._redis.delete(self._left_key(record.worker_id))
            await self._publish("join", record.worker_id, record.role, record.model)
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot register {record.worker_id}: {exc}") from exc
        logger.info("registered %s worker %s (%s)", record.role, record.worker_id, record.http_url)

    async def heartbeat(self, record: WorkerRecord) -> None:
        try:
            if await self._redis.pexpire(self._key(record.worker_id), self._ttl_ms):
                return
            # The key expired (or Redis restarted): write it again and announce the rejoin.
            await self._redis.set(self._key(record.worker_id), record.to_json(), px=self._ttl_ms)
            await self._publish("join", record.worker_id, record.role, record.model)
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot heartbeat {record.worker_id}: {exc}") from exc
        logger.warning("registry key of %s had expired; re-registered", record.worker_id)

    @property
    def _draining_key(self) -> str:
        return f"{self.prefix}:draining"

    async def mark_draining(self, worker_id: str) -> None:
        """Take ``worker_id`` out of routing (it keeps serving what it has) before a scale-down."""
        try:
            await self._redis.sadd(self._draining_key, worker_id)
            await self._publish("drain", worker_id)
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot mark {worker_id} draining: {exc}") from exc

    async def draining(self) -> set[str]:
        """Ids of workers being drained (routers send them no new requests)."""
        try:
            members = await self._redis.smembers(self._draining_key)
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot read draining workers: {exc}") from exc
        return {m.decode() if isinstance(m, bytes) else str(m) for m in members}

    def _left_key(self, worker_id: str) -> str:
        return f"{self.prefix}:left:{worker_id}"

    async def deregister(self, worker_id: str) -> None:
        try:
            await self._redis.set(self._left_key(worker_id), "1", px=TOMBSTONE_MS)
            await self._redis.srem(self._draining_key, worker_id)
            await self._redis.delete(self._key(worker_id))
            await self._publish("leave", worker_id)
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot deregister {worker_id}: {exc}") from exc
        logger.info("deregistered worker %s", worker_id)

    async def departed(self) -> set[str]:
        """Ids of workers that deregistered in the last few minutes (tombstones)."""
        prefix = self._left_key("")
        try:
            keys = [k async for k in self._redis.scan_iter(match=prefix + "*", count=500)]
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot read departed workers: {exc}") from exc
        return {(k.decode() if isinstance(k, bytes) else str(k))[len(prefix):] for k in keys}

    async def list(self) -> list[WorkerRecord]:
        try:
            keys = [k async for k in self._redis.scan_iter(match=self._key("*"), count=500)]
            raws = await self._redis.mget(keys) if keys else []
        except (RedisError, OSError) as exc:
            raise RegistryError(f"cannot list workers: {exc}") from exc
        records: list[WorkerRecord] = []
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                record = WorkerRecord.from_json(raw)
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("ignoring malformed registry entry %r: %s", key, exc)
                continue
            if self.trust is not None and not self.trust(record):
                if record.worker_id not in self._refused:
                    self._refused.add(record.worker_id)
                    logger.warning("ignoring worker %s (%s): its registration is not signed "
                                   "with the cluster secret", record.worker_id, record.http_url)
                continue
            records.append(record)
        return sorted(records, key=lambda r: r.worker_id)

    async def close(self) -> None:
        await self._redis.aclose()
