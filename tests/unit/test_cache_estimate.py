"""bench.cache_estimate's event replay: vLLM's own KV event types sent over a real ZMQ PUB socket
the way vLLM's publisher frames them, decoded and translated by the router's own code. (The
translation's semantics are tests/unit/test_kv_events.py's.)"""

from __future__ import annotations

import time

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from bench.cache_estimate import PREFILL, EventReplay, EventStream  # noqa: E402
from router.policy.cache_model import ClusterCacheModel  # noqa: E402
from router.policy.hashing import block_hashes  # noqa: E402
from router.policy.kv_events import KVEventTranslator  # noqa: E402
from serve.redis_server import free_port  # noqa: E402

PROMPT = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens more
OURS = block_hashes(PROMPT, 16)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> object:
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                 token_ids=tokens, block_size=16, lora_id=None, medium=None,
                                 lora_name=None)


def test_events_arrive_over_zmq_as_vllm_frames_them() -> None:
    import msgspec
    import zmq

    port = free_port()
    stream = EventStream(f"tcp://127.0.0.1:{port}")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")  # vLLM connects to a tcp://HOST:PORT endpoint
    replay = EventReplay(KVEventTranslator(PREFILL), ClusterCacheModel())
    replay.fed.insert(PREFILL, OURS)  # the router's dispatch
    try:
        batch = kv_events.KVEventBatch(ts=time.time(), events=[
            stored([11, 12, 13], None, PROMPT[:48]), stored([21], 99, PROMPT[:16])])
        payload = msgspec.msgpack.Encoder().encode(batch)
        deadline = time.monotonic() + 10
        while not replay.counts and time.monotonic() < deadline:
            pub.send_multipart([b"kv", (0).to_bytes(8, "big"), payload])
            stream.drain(replay.apply, quiet_s=0.2)
        assert replay.counts == {"stored": 1, "orphan": 1}  # block 21's parent is unknown
        assert replay.translator.cached_blocks(OURS) == 3
        removal = kv_events.KVEventBatch(ts=time.time(), events=[
            kv_events.BlockRemoved(block_hashes=[12], medium=None)])
        pub.send_multipart([b"kv", (1).to_bytes(8, "big"),
                            msgspec.msgpack.Encoder().encode(removal)])
        while replay.counts.get("removed", 0) == 0 and time.monotonic() < deadline:
            stream.drain(replay.apply, quiet_s=0.2)
        assert replay.translator.cached_blocks(OURS) == 1
        assert replay.fed.match(PREFILL, OURS) == 1  # the dispatch-only model would say 3
    finally:
        pub.close(linger=0)
        ctx.term()
        stream.close()
