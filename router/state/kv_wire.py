"""vLLM's KV cache event wire format, decoded without importing vLLM.

vLLM's ZMQ publisher (``vllm.distributed.kv_events.ZmqEventPublisher``) sends each batch as
three frames: the topic, an 8-byte big-endian sequence number, and a msgpack ``KVEventBatch``:
an array ``[ts, events, data_parallel_rank]`` (``array_like``, trailing defaults omitted) whose
events are maps tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``. These
Structs mirror vLLM 0.32's field names, order and tags (the router image need not ship vLLM, and
importing it costs seconds); ``tests/unit/test_kv_events.py`` encodes with vLLM's own classes.
Fields added by later vLLM versions are ignored (events are maps); block hashes are ``bytes``
(sha256, the default) or ``int`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import RouterError
from router.policy.base import CacheChanged
from router.policy.kv_events import KVEventTranslator

EngineHash = bytes | int


class KVEventsDecodeError(RouterError):
    """A message on a KV event stream is not a vLLM ``KVEventBatch``."""


class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    """vLLM's ``KVCacheEvent`` base (a map tagged by the class name)."""


class BlockStored(_Event):
    """New full blocks in the engine's prefix cache."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    """Blocks evicted from the engine's prefix cache."""

    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    """The engine's prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One published batch (one engine step's events)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in a message's last frame; :class:`KVEventsDecodeError` when it is not one."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVEventsDecodeError(f"not a vLLM KVEventBatch: {exc}") from exc


def kind(event: KVEvent) -> str:
    """The metric label of ``event``: ``stored``, ``removed`` or ``cleared``."""
    if isinstance(event, BlockStored):
        return "stored"
    return "removed" if isinstance(event, BlockRemoved) else "cleared"


def cache_salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` of a stored chain's first block: vLLM publishes each block's extra
    keys untagged, in order the LoRA name (when ``lora_name`` is set), ``(mm id, offset)``
    pairs, the salt (first block only) and prompt-embeds digests (bytes)."""
    keys = event.extra_keys[0] if event.extra_keys else None
    if not isinstance(keys, list | tuple):
        return None
    names = [k for k in keys if isinstance(k, str)]
    if event.lora_name is not None and names[:1] == [event.lora_name]:
        names = names[1:]
    return names[0] if names else None


def translate(translator: KVEventTranslator, event: KVEvent) -> CacheChanged | None:
    """``event`` through ``translator`` (None: nothing for the cache model)."""
    if isinstance(event, BlockStored):
        salt = cache_salt_of(event) if event.parent_block_hash is None else None
        return translator.stored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                 event.block_size, salt)
    if isinstance(event, BlockRemoved):
        return translator.removed(event.block_hashes)
    return translator.cleared()
