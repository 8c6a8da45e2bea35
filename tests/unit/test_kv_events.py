"""The router's view of vLLM's KV cache events (``--kv-events``): vLLM's own event classes and
publisher over a real ZMQ hop into the router's decoder and translator, then the cache model
and the prefix-aware policies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.errors import ConfigError
from router.placement import Pool
from router.policy.base import CacheChanged, Candidate, Membership, RouteRequest
from router.policy.cache_model import ClusterCacheModel
from router.policy.dualmap import DualMapPolicy
from router.policy.hashing import block_hashes
from router.policy.kv_events import KVEventTranslator
from router.policy.prefix_only import PrefixOnlyPolicy
from router.state.load import LoadTracker

PROMPT = tuple(range(1000, 1400))  # 400 tokens: 25 blocks of 16, 3 of vLLM-CPU's 128
OURS = block_hashes(PROMPT, 16)
W = "prefill-a"


def apply_all(model: ClusterCacheModel, *changes: CacheChanged | None) -> None:
    for change in changes:
        if change is not None:
            model.apply(change)


# -- the wire: vLLM's publisher -> ZMQ -> the router's subscriber ----------------------------

async def test_vllm_events_over_zmq_land_in_the_router_hash_space() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    from router.state.cluster import StaticCluster
    from router.state.kv_events import KVEventSubscriber
    from router.state.registry import WorkerRecord
    from serve.redis_server import free_port

    port = free_port()
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}",
                                     topic="kv")
    record = WorkerRecord(W, "prefill", "m", "/m", "http://127.0.0.1:1", "e", "", 4096, 0.0,
                          kv_events_endpoint=f"tcp://127.0.0.1:{port}")
    model = ClusterCacheModel()
    roles: list[str] = []
    counts: dict[str, int] = {}

    def deliver(role: str, change: CacheChanged) -> None:
        roles.append(role)
        model.apply(change)

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    def publish(*events: object) -> None:
        publisher.publish(kv.KVEventBatch(ts=0.0, events=list(events)))

    async def until(kind: str, n: int) -> None:
        while counts.get(kind, 0) < n:
            await asyncio.sleep(0.02)

    def stored(hashes: list[bytes | int], parent: bytes | int | None, tokens: tuple[int, ...]
               ) -> object:
        return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                              token_ids=list(tokens), block_size=128, lora_id=None,
                              medium="CPU", lora_name=None)

    sub = KVEventSubscriber(StaticCluster([record]), deliver, count)
    try:
        sub.sync()
        while not counts.get("cleared"):  # a SUB hears only what is sent once it is connected
            publish(kv.AllBlocksCleared())
            await asyncio.sleep(0.05)
        assert model.match(W, OURS) == 0  # negative control: nothing stored yet
        # a request's first two blocks, then a later request extends the chain by its parent
        publish(stored([b"v1", b"v2"], None, PROMPT[:256]))
        publish(stored([3], b"v2", PROMPT[256:384]))  # vLLM's int hash mode
        await until("stored", 2)
        assert model.match(W, OURS) == 24  # every full 128-token block, in our 16-token hashes
        publish(kv.BlockRemoved(block_hashes=[3], medium="CPU"))
        await until("removed", 1)
        assert model.match(W, OURS) == 16
        publish(kv.BlockRemoved(block_hashes=[b"v2"], medium="CPU"))
        await until("removed", 2)
        assert model.match(W, OURS) == 8
        publish(kv.AllBlocksCleared())
        await until("cleared", 2)
        assert model.match(W, OURS) == 0
        assert set(roles) == {"prefill"}
        stats = sub.stats(W)
        assert stats is not None and stats["engine_block_tokens"] == 128
        assert stats["live_blocks"] == 0 and stats["events"]["stored"] == 2
    finally:
        await sub.close()
        publisher.shutdown()


def test_the_decoder_reads_what_vllm_encodes() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    from router.state import kv_wire

    batch = kv.KVEventBatch(ts=1.5, data_parallel_rank=2, events=[
        kv.BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=None,
                       token_ids=list(PROMPT[:32]), block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0, session_id="s"),
        kv.BlockRemoved(block_hashes=[7], medium="GPU"), kv.AllBlocksCleared()])
    got = kv_wire.decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert (got.ts, got.data_parallel_rank) == (1.5, 2)
    first, second, third = got.events
    assert isinstance(first, kv_wire.BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size,
            first.medium, first.group_idx) == ([b"\x01" * 32, 7], None, list(PROMPT[:32]), 16,
                                                "GPU", 0)
    assert isinstance(second, kv_wire.BlockRemoved) and second.block_hashes == [7]
    assert isinstance(third, kv_wire.AllBlocksCleared)
    with pytest.raises(kv_wire.KVEventsDecodeError):
        kv_wire.decode_batch(b"\x93not a batch")


# -- the translator ----------------------------------------------------------------------------

def test_a_stored_block_with_an_unknown_parent_is_ignored_with_its_descendants() -> None:
    t = KVEventTranslator(W)
    model = ClusterCacheModel()
    # the router subscribed after block v1 was stored: v2 and its child cannot be hashed
    assert t.stored([b"v2"], b"v1", PROMPT[128:256], 128) is None
    assert t.stored([b"v3"], b"v2", PROMPT[256:384], 128) is None
    assert t.orphans == 2 and t.live_blocks == 0
    assert model.match(W, OURS) == 0
    # a block that starts a chain is always known
    apply_all(model, t.stored([b"v1"], None, PROMPT[:128], 128))
    assert model.match(W, OURS) == 8
    assert t.removed([b"v2"]) is None  # removing what was never known changes nothing


def test_a_block_lives_until_its_last_copy_is_removed() -> None:
    t = KVEventTranslator(W)
    model = ClusterCacheModel()
    apply_all(model, t.stored([b"v1", b"v2"], None, PROMPT[:256], 128),
              t.stored([b"v1"], None, PROMPT[:128], 128),  # a second copy of v1
              t.stored([b"s1"], None, PROMPT[:128], 128))  # same tokens, another hash (salt)
    assert t.removed([b"v1"]) is None
    assert t.removed([b"v1"]) is None
    assert model.match(W, OURS) == 16
    change = t.removed([b"s1"])
    assert change is not None and change.removed == OURS[:8]
    apply_all(model, change)
    assert model.match(W, OURS) == 0


def test_an_engine_block_size_that_is_not_a_multiple_of_ours_is_refused() -> None:
    t = KVEventTranslator(W, block_tokens=16)
    with pytest.raises(ConfigError, match="not a multiple of the router's 16-token blocks"):
        t.stored([1], None, PROMPT[:24], 24)
    assert t.stored([1], None, PROMPT[:32], 32) is not None  # 32 is


# -- the cache model -------------------------------------------------------------------------

def test_a_removal_in_the_middle_of_a_chain_ends_the_match_there() -> None:
    """The binary search's invariant (the cached part of a chain is a prefix) breaks when an
    engine evicts a middle block: the model then matches from the front, to the first miss."""
    model = ClusterCacheModel()
    model.insert(W, OURS)  # dispatched: the router records all 25 blocks
    control = ClusterCacheModel()
    control.insert(W, OURS)
    model.apply(CacheChanged(W, removed=(OURS[5],)))
    assert model.match(W, OURS) == 5  # a binary search would land behind the hole: 25
    assert control.match(W, OURS) == 25  # negative control: no event, no change
    model.apply(CacheChanged(W, cleared=True))
    assert model.match(W, OURS) == 0


def test_once_the_engine_block_size_is_known_dispatch_records_whole_engine_blocks() -> None:
    model = ClusterCacheModel()
    model.insert("other", OURS)
    assert model.match("other", OURS) == 25  # no events from it: every 16-token block
    model.apply(CacheChanged(W, engine_block_tokens=128))
    model.insert(W, OURS)
    assert model.match(W, OURS) == 24  # the engine caches no partial 128-token block


# -- the policies ----------------------------------------------------------------------------

def _pool_after_dispatch(policy: DualMapPolicy | PrefixOnlyPolicy
                         ) -> tuple[Pool, RouteRequest, list[Candidate], str]:
    """A prefill pool of two workers in which the prompt was dispatched to (and finished on)
    the worker the policy chose; returns (pool, request, candidates, that worker)."""
    pool = Pool("prefill", policy, LoadTracker())
    pool.sync("m", ("a", "b"))
    request = RouteRequest("r1", "m", prompt_token_ids=PROMPT, block_hashes=OURS)
    candidates = [Candidate("a"), Candidate("b")]
    first = pool.choose(request, candidates)
    assert first is not None
    pool.begin(request, first.worker)
    pool.end(request, first.worker)
    return pool, request, candidates, first.worker


def _evict_everything(pool: Pool, worker: str) -> None:
    """The worker's engine stores the prompt (16-token blocks), then evicts all of it."""
    t = KVEventTranslator(worker)
    hashes = [f"e{i}".encode() for i in range(len(OURS))]
    stored = t.stored(hashes, None, PROMPT, 16)
    assert stored is not None and stored.stored == OURS  # our hashes, from vLLM's event
    pool.tell(stored)
    removed = t.removed(hashes)
    assert removed is not None
    pool.tell(removed)


def test_dualmap_stops_counting_a_prompt_its_engine_evicted() -> None:
    pool, request, candidates, worker = _pool_after_dispatch(DualMapPolicy())
    control, *_ = _pool_after_dispatch(DualMapPolicy())
    _evict_everything(pool, worker)
    after, kept = pool.choose(request, candidates), control.choose(request, candidates)
    assert kept is not None and (kept.worker, kept.reason) == (worker, "cache_affinity")
    assert after is not None and after.reason == "load"  # neither holds the prompt now
    assert pool.cached_tokens(request, worker) == 0
    assert control.cached_tokens(request, worker) == len(OURS) * 16


def test_prefix_only_stops_counting_a_prompt_its_engine_evicted() -> None:
    pool, request, candidates, worker = _pool_after_dispatch(PrefixOnlyPolicy())
    assert pool.cached_tokens(request, worker) == len(OURS) * 16
    _evict_everything(pool, worker)
    assert pool.cached_tokens(request, worker) == 0
    # membership and dispatch still work after the events
    pool.tell(Membership("m", ("a", "b")))
    assert pool.choose(request, candidates) is not None


# -- the plumbing: worker flags, router flag, the router app ---------------------------------

def test_worker_kv_events_port_becomes_vllm_config_and_an_advertised_endpoint() -> None:
    import argparse
    import json

    from serve.worker import WorkerSettings, add_worker_args, kv_events_config, settings_from_args

    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    args = parser.parse_args(["--role", "prefill", "--model", "/m", "--host", "0.0.0.0",
                              "--advertise-host", "10.0.0.7", "--kv-events-port", "5601",
                              "--insecure"])
    settings = settings_from_args(args, [])
    assert settings.kv_events_endpoint == "tcp://10.0.0.7:5601"
    assert WorkerSettings("prefill", "/m").kv_events_endpoint == ""  # off by default
    kv = pytest.importorskip("vllm.config.kv_events")
    config = kv.KVEventsConfig(**json.loads(json.dumps(kv_events_config(5601))))
    assert (config.enable_kv_cache_events, config.publisher, config.endpoint, config.topic) == (
        True, "zmq", "tcp://*:5601", "kv")  # a wildcard: vLLM connects to any other endpoint
    assert config.replay_endpoint is None and settings.kv_events_replay_endpoint == ""
    args = parser.parse_args(["--role", "prefill", "--model", "/m", "--advertise-host",
                              "10.0.0.7", "--kv-events-port", "5601",
                              "--kv-events-replay-port", "5602", "--insecure"])
    assert settings_from_args(args, []).kv_events_replay_endpoint == "tcp://10.0.0.7:5602"
    config = kv.KVEventsConfig(**json.loads(json.dumps(kv_events_config(5601, 5602))))
    assert config.replay_endpoint == "tcp://*:5602"
    with pytest.raises(ValueError, match="needs --kv-events-port"):
        WorkerSettings("prefill", "/m", kv_events_replay_port=5602)
    # a Unix socket instead of a port: no interface at all
    ipc = WorkerSettings("prefill", "/m", kv_events_ipc="/run/p/prefill.sock")
    assert (ipc.kv_events_endpoint, ipc.kv_events_replay_endpoint) == (
        "ipc:///run/p/prefill.sock", "ipc:///run/p/prefill.sock.replay")
    config = kv.KVEventsConfig(**kv_events_config(0, 0, "/run/p/prefill.sock"))
    assert (config.endpoint, config.replay_endpoint) == (
        "ipc:///run/p/prefill.sock", "ipc:///run/p/prefill.sock.replay")
    with pytest.raises(ValueError, match="one or the other"):
        WorkerSettings("prefill", "/m", kv_events_port=5601, kv_events_ipc="/run/p/x.sock")


@pytest.mark.parametrize("host, ipc", [("127.0.0.1", True), ("0.0.0.0", False)])
def test_pdserve_up_keeps_kv_events_off_the_network_on_loopback(host: str, ipc: bool) -> None:
    import os
    import stat

    from serve.supervisor import Cluster, ClusterSettings

    sup = Cluster(ClusterSettings(host=host, kv_events=True))
    try:
        args = sup._kv_events_args("prefill-1")
        if ipc:
            assert args[0] == "--kv-events-ipc" and "--kv-events-port" not in args
            private = os.path.dirname(args[1])
            assert stat.S_IMODE(os.stat(private).st_mode) == 0o700  # this uid only
        else:  # control: a cluster on the network publishes on ports, with a replay port
            assert args[0::2] == ["--kv-events-port", "--kv-events-replay-port"]
    finally:
        sup.stop()


@pytest.mark.parametrize("extra, message", [
    (("--block-size", "24"), "not a multiple of the router's 16-token blocks"),
    (("--block-size=8",), "not a multiple"),
    (("--kv-events-config", "{}"), "give one or the other"),
])
def test_worker_refuses_kv_events_with_arguments_that_defeat_them(
        extra: tuple[str, ...], message: str) -> None:
    from serve.worker import WorkerSettings

    with pytest.raises(ValueError, match=message):
        WorkerSettings("prefill", "/m", kv_events_port=5601, extra_vllm_args=extra)
    WorkerSettings("prefill", "/m", extra_vllm_args=extra)  # without events: vLLM's business
    WorkerSettings("prefill", "/m", kv_events_port=5601, extra_vllm_args=("--block-size", "128"))


def test_router_kv_events_flag_and_env() -> None:
    from router.config import load

    assert load([], env={}).kv_events is False
    assert load(["--kv-events"], env={}).kv_events is True
    assert load([], env={"PDSERVE_ROUTER_KV_EVENTS": "1"}).kv_events is True


async def test_the_router_follows_a_prefill_engines_events_into_its_policy(
        tmp_path: Path) -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import httpx

    from router.api.app import create_app
    from router.api.tokenization import TokenizerCache
    from router.config import RouterSettings
    from router.samples import parse_samples, total
    from router.state.cluster import StaticCluster
    from router.state.registry import WorkerRecord
    from serve.redis_server import free_port
    from tests.fakes.fake_worker import build_tiny_tokenizer

    tokenizer = str(build_tiny_tokenizer(tmp_path))
    text = " ".join(f"word{i}" for i in range(300))
    ids = await TokenizerCache().count_completion(tokenizer, text)
    assert ids is not None and len(ids) > 256
    port = free_port()
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
    records = [WorkerRecord(W, "prefill", "m", tokenizer, "http://127.0.0.1:1", "e", "", 4096,
                            0.0, kv_events_endpoint=f"tcp://127.0.0.1:{port}"),
               WorkerRecord("decode-a", "decode", "m", "/m", "http://127.0.0.1:2", "e2", "",
                            4096, 0.0)]
    app = create_app(RouterSettings(kv_events=True, load_poll_interval_s=0,
                                    refresh_interval_s=0.05), cluster=StaticCluster(records))
    service = app.state.router
    request = RouteRequest("r", "m", prompt_token_ids=PROMPT, block_hashes=OURS)
    pool = service.placement.pool("prefill")

    def counted(text: str, kind: str) -> float:
        return total(parse_samples(text), "pdserve_router_kv_events_total", kind=kind)

    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            while not counted((await client.get("/metrics")).text, "cleared"):
                publisher.publish(kv.KVEventBatch(ts=0.0, events=[kv.AllBlocksCleared()]))
                await asyncio.sleep(0.05)
            assert pool.cached_tokens(request, W) == 0
            publisher.publish(kv.KVEventBatch(ts=0.0, events=[kv.BlockStored(
                block_hashes=[b"v1", b"v2", b"v3"], parent_block_hash=None,
                token_ids=list(PROMPT[:384]), block_size=128, lora_id=None, medium="CPU",
                lora_name=None)]))
            while not counted((await client.get("/metrics")).text, "stored"):
                await asyncio.sleep(0.05)
            assert pool.cached_tokens(request, W) == 384  # the policy's model holds the blocks
            workers = {w["worker_id"]: w for w in (await client.get("/workers")).json()["data"]}
            assert workers[W]["kv_events"]["live_blocks"] == 3
            assert workers[W]["kv_events"]["engine_block_tokens"] == 128
            assert workers["decode-a"]["kv_events"] is None  # decode engines are not followed

            async def cached_for_text() -> int:
                data = (await client.get("/workers", params={"prompt": text})).json()["data"]
                return {w["worker_id"]: w for w in data}[W]["cached_prompt_tokens"]  # type: ignore[no-any-return]

            assert await cached_for_text() == 0  # negative control: the engine holds no text
            publisher.publish(kv.KVEventBatch(ts=0.0, events=[kv.BlockStored(
                block_hashes=[b"t1", b"t2"], parent_block_hash=None, token_ids=ids[:256],
                block_size=128, lora_id=None, medium="CPU", lora_name=None)]))
            while await cached_for_text() == 0:
                await asyncio.sleep(0.05)
            assert await cached_for_text() == 256  # /workers?prompt= tokenizes as requests do
    finally:
        publisher.shutdown()


async def test_the_subscriber_follows_membership() -> None:
    pytest.importorskip("zmq")
    from router.state.cluster import StaticCluster
    from router.state.kv_events import KVEventSubscriber
    from router.state.registry import WorkerRecord

    def record(wid: str, role: str, endpoint: str) -> WorkerRecord:
        return WorkerRecord(wid, role, "m", "/m", "http://127.0.0.1:1", "e", "", 4096, 0.0,  # type: ignore[arg-type]
                            kv_events_endpoint=endpoint)

    cluster = StaticCluster([record("p", "prefill", "tcp://127.0.0.1:9"),
                             record("a", "aggregated", "tcp://127.0.0.1:10"),
                             record("d", "decode", "tcp://127.0.0.1:11"),
                             record("q", "prefill", "")])
    sub = KVEventSubscriber(cluster, lambda role, change: None)
    try:
        sub.sync()
        followed = {w: sub.stats(w) is not None for w in ("p", "a", "d", "q")}
        assert followed == {"p": True, "a": True, "d": False, "q": False}
        cluster.records = (record("a", "aggregated", "tcp://127.0.0.1:10"),)  # p left
        sub.sync()
        assert sub.stats("p") is None and sub.stats("a") is not None
    finally:
        await sub.close()


def test_pdserve_up_kv_events_flag() -> None:
    import argparse

    from serve.supervisor import add_up_args, settings_from_args

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    assert settings_from_args(parser.parse_args([])).kv_events is False
    assert settings_from_args(parser.parse_args(["--kv-events"])).kv_events is True


def test_a_partial_block_store_does_not_shrink_the_engine_block_size() -> None:
    """vLLM also caches a block's filled part (a BlockStored shorter than its block)."""
    t = KVEventTranslator(W)
    model = ClusterCacheModel()
    apply_all(model, t.stored([b"v1"], None, PROMPT[:128], 128),
              t.stored([b"p2"], b"v1", PROMPT[128:208], 80))
    assert t.engine_block_tokens == 128
    assert model.match(W, OURS) == 13  # the partial block's 5 blocks of 16 are cached
    fresh = ClusterCacheModel()
    for size in (80, 128, 80):
        fresh.apply(CacheChanged(W, engine_block_tokens=size))
    fresh.insert(W, OURS)
    assert fresh.match(W, OURS) == 24  # dispatch: whole 128-token blocks (80 would give 20)


@pytest.mark.parametrize("lora", [None, "adapter-1"])
def test_a_salted_chain_lands_under_its_salt(lora: str | None) -> None:
    """vLLM publishes the first block's ``cache_salt`` in its extra keys (after a LoRA name):
    the router hashes that chain under the salt, as it hashes the salted request it routed.
    Control: the same tokens stored without a salt land under the unsalted hashes."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    from router.policy.hashing import salt_seed
    from router.state import kv_wire

    first = (*([lora] if lora else []), "salt-a")
    batch = kv.KVEventBatch(ts=0.0, events=[
        kv.BlockStored(block_hashes=[b"s1"], parent_block_hash=None,
                       token_ids=list(PROMPT[:128]), block_size=128, lora_id=None,
                       medium="CPU", lora_name=lora, extra_keys=[first]),
        kv.BlockStored(block_hashes=[b"s2"], parent_block_hash=b"s1",
                       token_ids=list(PROMPT[128:256]), block_size=128, lora_id=None,
                       medium="CPU", lora_name=lora, extra_keys=[(lora,) if lora else None]),
        kv.BlockStored(block_hashes=[b"u1"], parent_block_hash=None,
                       token_ids=list(PROMPT[:128]), block_size=128, lora_id=None,
                       medium="CPU", lora_name=None)])
    events = kv_wire.decode_batch(msgspec.msgpack.Encoder().encode(batch)).events
    t = KVEventTranslator(W)
    model = ClusterCacheModel()
    apply_all(model, *(kv_wire.translate(t, e) for e in events))
    salted = block_hashes(PROMPT, 16, seed=salt_seed("salt-a"))
    assert model.match(W, salted) == 16  # both engine blocks, chained under the salt
    assert model.match(W, OURS) == 8  # the unsalted copy: its own 8 blocks only
    assert not set(salted[:16]) & set(OURS[:16])


# -- bounded memory and lost batches (security review finding 9) ------------------------------

def test_a_publisher_that_only_stores_cannot_grow_the_translator_past_its_cap() -> None:
    t = KVEventTranslator(W, max_blocks=2)
    model = ClusterCacheModel()
    apply_all(model, t.stored([b"v1", b"v2"], None, PROMPT[:256], 128))
    assert model.match(W, OURS) == 16 and t.evicted == 0  # control: at the cap, nothing lost
    other = tuple(range(5000, 5128))
    change = t.stored([b"x1"], None, other, 128)
    apply_all(model, change)
    assert t.live_blocks == 2 and t.evicted == 1
    assert change is not None and set(change.removed) == set(OURS[:8])  # the oldest block
    assert model.match(W, OURS) == 0 and model.match(W, block_hashes(other, 16)) == 8
    for i in range(100):  # a flood of distinct chains stays at the cap
        t.stored([f"f{i}".encode()], None, tuple(range(i * 128, (i + 1) * 128)), 128)
    assert t.live_blocks == 2 and t.live_hashes == 16 and t.evicted == 101


class _CuttableLink:
    """A TCP forwarder between the router's SUB socket and vLLM's publisher that the test can
    cut, as a network blip would: while it is down, the publisher's batches are lost."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.down = False
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.down = True
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


@pytest.mark.parametrize("mode", ["replayed", "no-replay-socket", "buffer-rolled"])
async def test_batches_lost_in_a_gap_are_replayed_or_the_view_is_forgotten(mode: str) -> None:
    """A removal published while the connection was down must not leave the router believing
    the engine still caches the block: with a replay socket the missed batches are applied in
    order; without one, or when its buffer no longer holds them, the engine's view is
    forgotten (never stale)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    from router.state.cluster import StaticCluster
    from router.state.kv_events import KVEventSubscriber
    from router.state.registry import WorkerRecord
    from serve.redis_server import free_port

    replay = mode == "replayed"
    port, replay_port = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic="kv",
        buffer_steps=1 if mode == "buffer-rolled" else 10_000,
        replay_endpoint=None if mode == "no-replay-socket" else f"tcp://*:{replay_port}")
    link = _CuttableLink(port)
    record = WorkerRecord(W, "prefill", "m", "/m", "http://127.0.0.1:1", "e", "", 4096, 0.0,
                          kv_events_endpoint=f"tcp://127.0.0.1:{await link.start()}",
                          kv_events_replay_endpoint="" if mode == "no-replay-socket"
                          else f"tcp://127.0.0.1:{replay_port}")
    model = ClusterCacheModel()
    counts: dict[str, int] = {}
    other = tuple(range(5000, 5256))

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    def publish(*events: object) -> None:
        publisher.publish(kv.KVEventBatch(ts=0.0, events=list(events)))

    def stored(hashes: list[bytes], parent: bytes | None, tokens: tuple[int, ...]) -> object:
        return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                              token_ids=list(tokens), block_size=128, lora_id=None,
                              medium="CPU", lora_name=None)

    async def until(kind: str, n: int = 1, probe: object = None) -> None:
        for _ in range(1000):
            if counts.get(kind, 0) >= n:
                return
            if probe is not None:
                publish(probe)
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {kind} event within 20 s; counted {counts}")

    sub = KVEventSubscriber(StaticCluster([record]), lambda role, change: model.apply(change),
                            count)
    try:
        sub.sync()
        await until("cleared", probe=kv.AllBlocksCleared())
        publish(stored([b"v1", b"v2"], None, PROMPT[:256]))
        await until("stored")
        assert model.match(W, OURS) == 16
        link.cut()
        # lost: the engine evicts v2 and caches another prompt
        publish(kv.BlockRemoved(block_hashes=[b"v2"], medium="CPU"))
        publish(stored([b"o1", b"o2"], None, other))
        await asyncio.sleep(0.3)
        assert model.match(W, OURS) == 16  # the router's view is stale now
        link.down = False
        # after the gap: a harmless batch (an unknown removal) until the SUB has reconnected
        await until("gap", probe=kv.BlockRemoved(block_hashes=[b"unknown"], medium="CPU"))
        await until("replayed", 2) if replay else await until("resync_cleared")
        if replay:  # the removal, the store, and any probe sent before the SUB was back
            assert counts["replayed"] >= 2 and "resync_cleared" not in counts
            assert model.match(W, OURS) == 8  # v2's removal applied, v1 still cached
            assert model.match(W, block_hashes(other, 16)) == 16  # the lost store too
        else:
            assert counts["resync_cleared"] == 1 and "replayed" not in counts
            assert model.match(W, OURS) == 0  # forgotten, not stale
        stats = sub.stats(W)
        assert stats is not None and stats["events"]["gap"] == 1
    finally:
        await sub.close()
        await link.close()
        publisher.shutdown()
