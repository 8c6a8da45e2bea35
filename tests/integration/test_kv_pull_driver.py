"""A decode's pull moves on between engine steps: real UCX between two real processes.

The connector's worker half used to advance a pull only when vLLM asked for finished transfers,
once per step, so a pull took three forward passes to report: its read seen at the end of one,
its release answered at the end of the next. Now a thread of its own sends the release as soon
as the read lands. Here a spawned process is the prefill engine (its KV tensor registered, a
lease granted); the pytest process is the decode, which starts the pull as a step is bound and
then makes no call at all until the prefill says the lease was released. That release can only
have come from the driver thread: without it, nothing would send it until the next ``poll``.
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


def _config() -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"transport": "ucx", "lease_s": 60.0,
                                              "pull_timeout_s": 20.0})


def _pattern() -> torch.Tensor:
    return torch.arange(NUM_BLOCKS * BLOCK_TOKENS * 8, dtype=torch.float32).reshape(
        NUM_BLOCKS, BLOCK_TOKENS, 8)


def _prefill(conn: Any) -> None:
    """Prefill process: register a patterned KV tensor, grant the leases it is sent, report
    how many were released."""
    half = WorkerHalf("prefill-engine", _config(), FACTS, NUM_BLOCKS)
    kv = _pattern()
    half.register_kv_caches({"layer.0": kv})
    assert half.handshake is not None
    conn.send(half.handshake.to_wire())
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg == "released":
            conn.send(half.leases.num_released)
            continue
        request_id, token = msg
        half.begin_step(PdserveMetadata(leases={request_id: (time.monotonic() + 60.0, token)}))
        conn.send("granted")
    half.shutdown()


@pytest.fixture
def prefill() -> Iterator[tuple[Any, str]]:
    with spawned(_prefill, START_S) as started:
        yield started


def _lease(conn: Any, request_id: str) -> str:
    token = new_lease_token()
    conn.send((request_id, token))
    assert conn.recv() == "granted"
    return token


def _released(conn: Any) -> int:
    conn.send("released")
    released: int = conn.recv()
    return released


def test_the_release_goes_out_when_the_read_lands_not_at_the_next_step(
        prefill: tuple[Any, str]) -> None:
    conn, handshake = prefill
    decode = WorkerHalf("decode-engine", _config(), FACTS, NUM_BLOCKS)
    kv = torch.zeros(NUM_BLOCKS, BLOCK_TOKENS, 8)
    decode.register_kv_caches({"layer.0": kv})
    try:
        token = _lease(conn, "p-1")
        remote = RemotePrefill("prefill-engine", "p-1", (5, 6), handshake,
                               2 * BLOCK_TOKENS, token)
        decode.begin_step(PdserveMetadata(pulls=[PullSpec("d-1", (1, 2), remote)]))
        deadline = time.monotonic() + DEADLINE_S
        while _released(conn) == 0:  # no poll: only the driver thread can move the pull
            assert time.monotonic() < deadline, "the release was never sent between steps"
            time.sleep(0.01)
        deadline = time.monotonic() + DEADLINE_S
        recving: set[str] = set()
        while "d-1" not in recving:  # the answer to the release, then the step's report
            assert time.monotonic() < deadline, "the answered pull was never reported"
            recving |= decode.poll()[1]
        assert decode.take_load_errors() == set()
        assert torch.equal(kv[1:3], _pattern()[5:7])
        assert not kv[0].any() and not kv[3:].any()  # nothing but the pulled blocks written

        # control: a pull whose token the prefill never granted is read, but its release is
        # refused, so it reports as a load error (vLLM recomputes), never as good KV
        remote = RemotePrefill("prefill-engine", "p-1", (5, 6), handshake,
                               2 * BLOCK_TOKENS, new_lease_token())
        decode.begin_step(PdserveMetadata(pulls=[PullSpec("d-2", (3, 4), remote)]))
        deadline = time.monotonic() + DEADLINE_S
        recving = set()
        while "d-2" not in recving:
            assert time.monotonic() < deadline, "the refused pull was never reported"
            recving |= decode.poll()[1]
        assert decode.take_load_errors() == {3, 4}
    finally:
        decode.shutdown()


def test_a_pull_started_when_bound_is_not_started_again_by_start_load_kv(
        prefill: tuple[Any, str]) -> None:
    """vLLM hands the same step's metadata to ``start_load_kv`` after the forward: a pull the
    binding started must not be read (and released) twice. Control: metadata that was never
    bound is started there."""
    conn, handshake = prefill
    decode = WorkerHalf("decode-engine", _config(), FACTS, NUM_BLOCKS)
    kv = torch.zeros(NUM_BLOCKS, BLOCK_TOKENS, 8)
    decode.register_kv_caches({"layer.0": kv})
    try:
        for n, (request_id, bind) in enumerate((("d-3", True), ("d-4", False)), start=1):
            token = _lease(conn, f"p-{request_id}")
            remote = RemotePrefill("prefill-engine", f"p-{request_id}", (5, 6), handshake,
                                   2 * BLOCK_TOKENS, token)
            meta = PdserveMetadata(pulls=[PullSpec(request_id, (1, 2), remote)])
            if bind:
                decode.begin_step(meta)
                deadline = time.monotonic() + DEADLINE_S
                while _released(conn) < n:  # read and released: a second read would now
                    assert time.monotonic() < deadline, "the bound pull was never released"
                    time.sleep(0.01)  # find the lease gone and report a load error
            decode.start_step(meta)
            deadline = time.monotonic() + DEADLINE_S
            recving: set[str] = set()
            while request_id not in recving:
                assert time.monotonic() < deadline, f"{request_id} was never reported"
                recving |= decode.poll()[1]
            time.sleep(0.3)  # a second pull of the same spec would have reported by now
            assert decode.poll()[1] == set()
            assert decode.take_load_errors() == set()
            assert _released(conn) == n  # one release per lease
    finally:
        decode.shutdown()
