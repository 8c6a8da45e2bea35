"""Worker registry and cluster view against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis

from router.errors import RegistryError
from router.state.cluster import ClusterView
from router.state.registry import WorkerRecord, WorkerRegistry
from serve.redis_server import RedisServer, free_port, start_redis


def _record(worker_id: str, role: str = "prefill", model: str = "tiny") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, model=model, model_path="/m",  # type: ignore[arg-type]
                        http_url="http://127.0.0.1:1", engine_id=f"e-{worker_id}",
                        ucx_address="dWN4", max_model_len=128, started_at=1.5)


async def _until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_record_json_roundtrip() -> None:
    rec = _record("w1")
    assert WorkerRecord.from_json(rec.to_json()) == rec
    assert WorkerRecord.from_json(rec.to_json().encode()) == rec
    data = json.loads(rec.to_json())
    data["future_field"] = 1
    assert WorkerRecord.from_json(json.dumps(data)) == rec
    with pytest.raises(ValueError):
        WorkerRecord.from_json(rec.to_json().replace('"prefill"', '"encode"'))


async def test_register_list_deregister_and_events(redis_server: RedisServer) -> None:
    reg = WorkerRegistry(redis_server.url, prefix="t1", ttl_s=30)
    sub = aioredis.from_url(redis_server.url)
    pubsub = sub.pubsub()
    await pubsub.subscribe("t1:events")
    await pubsub.get_message(timeout=1.0)  # subscribe confirmation
    try:
        await reg.register(_record("b", role="decode"))
        await reg.register(_record("a"))
        assert [r.worker_id for r in await reg.list()] == ["a", "b"]
        assert (await reg.list())[1] == _record("b", role="decode")
        ttl_ms = await sub.pttl("t1:worker:a")
        assert 0 < ttl_ms <= 30_000
        await reg.deregister("a")
        assert [r.worker_id for r in await reg.list()] == ["b"]
        events = []
        while len(events) < 3:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
            assert msg is not None, f"missing events, got {events}"
            events.append(json.loads(msg["data"]))
        assert [(e["type"], e["worker_id"]) for e in events] == [
            ("join", "b"), ("join", "a"), ("leave", "a")]
        assert events[0]["role"] == "decode" and events[0]["model"] == "tiny"
    finally:
        await pubsub.aclose()
        await sub.aclose()
        await reg.close()


async def test_heartbeat_expiry_and_rejoin(redis_server: RedisServer) -> None:
    reg = WorkerRegistry(redis_server.url, prefix="t2", ttl_s=0.3)
    raw = aioredis.from_url(redis_server.url)
    try:
        rec = _record("w")
        await reg.register(rec)
        await raw.pexpire("t2:worker:w", 100_000)
        await reg.heartbeat(rec)  # refreshes the TTL back to ttl_s
        assert 0 < await raw.pttl("t2:worker:w") <= 300

        async def gone() -> bool:
            return await reg.list() == []

        await _until(gone)  # no heartbeat: the key expires by itself
        await reg.heartbeat(rec)  # heartbeat after expiry writes the record again
        assert await reg.list() == [rec]
    finally:
        await raw.aclose()
        await reg.close()


async def test_malformed_entries_are_skipped(redis_server: RedisServer) -> None:
    reg = WorkerRegistry(redis_server.url, prefix="t3")
    raw = aioredis.from_url(redis_server.url)
    try:
        await raw.set("t3:worker:bad", b"{not json")
        await raw.set("t3:worker:partial", json.dumps({"worker_id": "partial"}))
        await reg.register(_record("good"))
        assert [r.worker_id for r in await reg.list()] == ["good"]
    finally:
        await raw.aclose()
        await reg.close()


async def test_unreachable_redis_raises_registry_error() -> None:
    reg = WorkerRegistry(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(RegistryError):
            await reg.list()
        with pytest.raises(RegistryError):
            await reg.register(_record("x"))
    finally:
        await reg.close()


async def test_cluster_view_keeps_last_membership_when_redis_dies() -> None:
    server = start_redis()
    reg = WorkerRegistry(server.url, prefix="t4", ttl_s=30)
    view = ClusterView(WorkerRegistry(server.url, prefix="t4"), refresh_interval_s=0.05)
    try:
        await reg.register(_record("p0"))
        await reg.register(_record("d0", role="decode"))
        await view.start()
        assert view.redis_ok
        assert [r.worker_id for r in view.workers("prefill")] == ["p0"]
        assert [r.worker_id for r in view.workers("decode", "tiny")] == ["d0"]
        assert view.workers("decode", "other") == []
        assert view.models() == ["tiny"]
        server.stop()

        async def down() -> bool:
            return not view.redis_ok

        await _until(down)
        assert [r.worker_id for r in view.workers()] == ["d0", "p0"]
    finally:
        await view.close()
        await reg.close()
        server.stop()


async def test_cluster_view_tells_join_listeners_in_the_update_that_adds_the_worker(
        redis_server: RedisServer) -> None:
    """Each join is told once, with the worker already routable when the listener runs (the
    re-dispatch step placed there sees it); a listener that raises stops nothing. Control: a
    refresh with no change tells nobody."""
    reg = WorkerRegistry(redis_server.url, prefix="t5", ttl_s=30)
    view = ClusterView(WorkerRegistry(redis_server.url, prefix="t5"), refresh_interval_s=3600)
    told: list[tuple[list[str], list[str]]] = []

    def listener(records) -> None:  # type: ignore[no-untyped-def]
        told.append(([r.worker_id for r in records], [r.worker_id for r in view.workers()]))

    def broken(records) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("a listener bug")

    view.on_join(broken)
    view.on_join(listener)
    try:
        await reg.register(_record("p0"))
        await view.start()
        assert told == [(["p0"], ["p0"])]
        await view.refresh()
        assert told == [(["p0"], ["p0"])]  # control: nothing joined
        await reg.register(_record("d1", role="decode"))
        await view.refresh()
        assert told[1:] == [(["d1"], ["d1", "p0"])]
        await reg.deregister("d1")
        await view.refresh()
        assert len(told) == 2 and [r.worker_id for r in view.workers()] == ["p0"]
    finally:
        await view.close()
        await reg.close()
