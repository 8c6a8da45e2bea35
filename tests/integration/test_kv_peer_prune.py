"""Two flex engines pull from each other: pruning an idle endpoint must not break the other way.

Real UCX between two real processes. Engine A (a spawned process) pulled from engine B once;
B keeps pulling from A. A's endpoint to B is idle, but UCX pairs it with B's endpoint to A, so
aborting it broke B's next release request to A until UCX reported the connection reset (14-19 s
here, 8 s on the benchmark box) and B's pull failed (vLLM would recompute the prompt). A now
keeps an endpoint to an engine that still asks it for releases, and disconnects it once the two
are idle both ways.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtransfer.config import ConnectorConfig
from kvtransfer.connector.metadata import PdserveMetadata, PullSpec
from kvtransfer.connector.worker import WorkerHalf
from kvtransfer.protocol import RemotePrefill, new_lease_token
from tests.support.spawned import spawned

NUM_BLOCKS = 8
BLOCK_TOKENS = 16
FACTS: dict[str, object] = {"model": "test", "dtype": "torch.float32", "block_size": BLOCK_TOKENS}
DEADLINE_S = 30.0  # generous bounds; never asserted as durations
START_S = 120.0
IDLE_S = 1.0
"""The idle bound both engines run with here (PEER_IDLE_S is 120 s)."""


def _config() -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"transport": "ucx", "lease_s": 60.0,
                                              "pull_timeout_s": 20.0})


def _pattern(offset: float) -> torch.Tensor:
    return offset + torch.arange(NUM_BLOCKS * BLOCK_TOKENS * 8, dtype=torch.float32).reshape(
        NUM_BLOCKS, BLOCK_TOKENS, 8)


def _pull(half: WorkerHalf, request_id: str, local: tuple[int, ...],
          remote: RemotePrefill) -> set[int]:
    """Pull ``remote`` into ``local`` blocks; the load errors (empty: the KV arrived)."""
    half.begin_step(PdserveMetadata(pulls=[PullSpec(request_id, local, remote)]))
    deadline = time.monotonic() + DEADLINE_S
    recving: set[str] = set()
    while request_id not in recving:
        assert time.monotonic() < deadline, f"{request_id} was never reported"
        recving |= half.poll()[1]
        time.sleep(0.005)
    return half.take_load_errors()


def _engine_a(conn: Any) -> None:
    """Engine A: grants the leases it is sent, pulls from B when told, prunes when told."""
    half = WorkerHalf("engine-a", _config(), FACTS, NUM_BLOCKS)
    half.register_kv_caches({"layer.0": _pattern(0.0)})
    half.peer_idle_s = IDLE_S
    assert half.handshake is not None
    conn.send(half.handshake.to_wire())
    b_handshake = conn.recv()
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg[0] == "grant":
            _, request_id, token = msg
            half.begin_step(PdserveMetadata(leases={request_id: (time.monotonic() + 60.0,
                                                                  token)}))
            conn.send("granted")
        elif msg[0] == "pull":
            _, request_id, token = msg
            remote = RemotePrefill("engine-b", request_id, (5, 6), b_handshake,
                                   2 * BLOCK_TOKENS, token)
            conn.send(_pull(half, f"a-{request_id}", (1, 2), remote))
        elif msg[0] == "prune":
            with half._lock:
                half._prune_peers(time.monotonic())
                conn.send(sorted(half._peers))
    half.shutdown()


@pytest.fixture
def engine_a() -> Iterator[tuple[Any, str]]:
    with spawned(_engine_a, START_S) as started:
        yield started


def test_an_engine_still_asking_for_releases_keeps_the_endpoint_it_is_paired_with(
        engine_a: tuple[Any, str]) -> None:
    conn, a_handshake = engine_a
    b = WorkerHalf("engine-b", _config(), FACTS, NUM_BLOCKS)
    b_kv = _pattern(1000.0)
    b.register_kv_caches({"layer.0": b_kv})
    b.peer_idle_s = IDLE_S
    assert b.handshake is not None
    conn.send(b.handshake.to_wire())
    try:
        # A pulls from B once: A now holds an endpoint to B
        token = new_lease_token()
        b.begin_step(PdserveMetadata(leases={"b-1": (time.monotonic() + 60.0, token)}))
        conn.send(("pull", "b-1", token))
        assert conn.recv() == set()
        time.sleep(IDLE_S + 0.2)  # A's endpoint to B goes idle

        def b_pulls_from_a(n: int) -> set[int]:
            token = new_lease_token()
            conn.send(("grant", f"a-{n}", token))
            assert conn.recv() == "granted"
            remote = RemotePrefill("engine-a", f"a-{n}", (3, 4), a_handshake,
                                   2 * BLOCK_TOKENS, token)
            return _pull(b, f"b-{n}", (1, 2), remote)

        assert b_pulls_from_a(1) == set()  # B asks A: A's endpoint to B is in use again
        conn.send(("prune",))
        assert conn.recv() == ["engine-b"]  # kept: B asked within the idle bound
        b_kv[1:3] = 0.0
        assert b_pulls_from_a(2) == set()  # without the fix: "Connection reset", recomputed
        assert torch.equal(b_kv[1:3], _pattern(0.0)[3:5])

        # control: idle both ways, the endpoint is still disconnected
        time.sleep(IDLE_S + 0.2)
        conn.send(("prune",))
        assert conn.recv() == []
    finally:
        b.shutdown()
