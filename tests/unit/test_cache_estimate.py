"""bench.cache_estimate's replica of vLLM's prefix cache, rebuilt from vLLM's own KV event types
(and, once, sent over a real ZMQ PUB socket the way vLLM's publisher frames them)."""

from __future__ import annotations

import time

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from bench.cache_estimate import CacheReplica, EventStream  # noqa: E402
from serve.redis_server import free_port  # noqa: E402

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> object:
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                 token_ids=tokens, block_size=BS, lora_id=None, medium=None,
                                 lora_name=None)


PROMPT = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens more


def test_a_chain_of_stored_blocks_is_a_cached_prefix() -> None:
    r = CacheReplica()
    r.apply(stored([11, 12], None, PROMPT[:8]))
    assert r.cached_tokens(PROMPT, BS) == 8
    r.apply(stored([13], 12, PROMPT[8:12]))  # a later request extends the chain by parent
    assert r.cached_tokens(PROMPT, BS) == 12
    # negative controls: another first block, and the same blocks under another parent
    assert r.cached_tokens([1, *PROMPT[1:]], BS) == 0
    r2 = CacheReplica()
    r2.apply(stored([13], None, PROMPT[8:12]))
    assert r2.cached_tokens(PROMPT, BS) == 0


def test_a_removed_block_ends_the_cached_prefix_and_duplicates_are_counted() -> None:
    r = CacheReplica()
    r.apply(stored([11, 12, 13], None, PROMPT[:12]))
    r.apply(stored([21, 22], None, PROMPT[:8]))  # same content under other vLLM hashes
    r.apply(kv_events.BlockRemoved(block_hashes=[12], medium=None))
    assert r.cached_tokens(PROMPT, BS) == 12  # block 2's content still lives in hash 22
    r.apply(kv_events.BlockRemoved(block_hashes=[22], medium=None))
    assert r.cached_tokens(PROMPT, BS) == 4
    assert (r.stored, r.removed) == (5, 2)
    r.apply(kv_events.AllBlocksCleared())
    assert r.cached_tokens(PROMPT, BS) == 0


def test_events_arrive_over_zmq_as_vllm_frames_them() -> None:
    import msgspec
    import zmq

    port = free_port()
    stream = EventStream(f"tcp://127.0.0.1:{port}")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")  # vLLM connects to a tcp://HOST:PORT endpoint
    try:
        batch = kv_events.KVEventBatch(ts=time.time(),
                                       events=[stored([11, 12, 13], None, PROMPT[:12])])
        payload = msgspec.msgpack.Encoder().encode(batch)
        replica = CacheReplica()
        deadline = time.monotonic() + 10
        while replica.stored == 0 and time.monotonic() < deadline:
            pub.send_multipart([b"kv", (0).to_bytes(8, "big"), payload])
            stream.drain(replica, quiet_s=0.2)
        assert replica.cached_tokens(PROMPT, BS) == 12
    finally:
        pub.close(linger=0)
        ctx.term()
        stream.close()
