"""The NIXL transport between real processes (spawned server, pytest process as client).

Runs over NIXL's UCX with its default transports and with `UCX_TLS=tcp` (READs emulated with
messages the server must progress: its `wait_requests` loop does, since `reads_expected`
says so). The lease protocol above it is tested end to end in tests/e2e.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtransfer.config import ConnectorConfig
from kvtransfer.errors import PeerUnreachable, TransportError
from kvtransfer.transport.base import Pending
from kvtransfer.transport.factory import open_transport
from kvtransfer.transport.nixl import NixlEngine, decode_address, encode_address

BLOCK = 32 << 10
NUM_BLOCKS = 128  # 4 MiB served region
SEED = 99
DEADLINE_S = 20.0  # generous bound; never asserted as a duration
NIXL = ConnectorConfig(transport="nixl")
ROOT = Path(__file__).resolve().parents[2]


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(conn: Any) -> None:
    """Server process: register a patterned buffer, ship its coordinates, echo requests."""
    engine = open_transport(NIXL, label="test-server", reads_expected=lambda: True)
    buf = _pattern(NUM_BLOCKS * BLOCK, SEED)
    region = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    conn.send((engine.address, buf.ctypes.data, buf.nbytes, region.rkey))
    while not (conn.poll(0) and conn.recv() == "stop"):
        if engine.wait_requests(0.05):
            for req in engine.poll_requests():
                req.reply(b"re:" + req.payload)
    engine.close()


@dataclass
class Server:
    proc: Any
    conn: Any
    address: bytes
    base: int
    length: int
    rkey: bytes

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def tls(ucx_tls: str) -> str:
    """UCX_TLS for both processes (set before either creates its NIXL agent)."""
    return ucx_tls


@pytest.fixture(scope="module")
def server(tls: str) -> Iterator[Server]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(60):
        proc.kill()
        pytest.fail("server did not publish its NIXL address")
    srv = Server(proc, parent, *parent.recv())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tls: str) -> Iterator[NixlEngine]:
    engine = NixlEngine(name=f"test-client-{tls}")
    yield engine
    engine.close()


def _wait(pending: Pending) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while (state := pending.poll()) == "pending" and time.monotonic() < deadline:
        time.sleep(0.0005)
    return state


def test_get_pulls_scattered_runs_exactly(server: Server, client: NixlEngine) -> None:
    local = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    client.register(local.ctypes.data, local.nbytes, keepalive=local)
    link = client.connect(server.address)
    index = link.unpack_rkey(server.rkey, base=server.base, length=server.length)
    # (local block, remote block, blocks): out of order, one of them a 5-block run
    runs = [(3, 40, 1), (10, 0, 5), (0, NUM_BLOCKS - 1, 1)]
    ops = np.array([[local.ctypes.data + lb * BLOCK, server.base + rb * BLOCK, n * BLOCK, index]
                    for lb, rb, n in runs], dtype=np.uint64)
    assert _wait(link.get(ops)) == "done"
    expected = _pattern(NUM_BLOCKS * BLOCK, SEED)
    for lb, rb, n in runs:
        assert np.array_equal(local[lb * BLOCK:(lb + n) * BLOCK],
                              expected[rb * BLOCK:(rb + n) * BLOCK])
    untouched = np.ones(NUM_BLOCKS, dtype=bool)
    for lb, _, n in runs:
        untouched[lb:lb + n] = False
    assert not local.reshape(NUM_BLOCKS, BLOCK)[untouched].any()


def test_request_reply_round_trips(server: Server, client: NixlEngine) -> None:
    link = client.connect(server.address)
    pendings = [link.request(f"done r{i}".encode()) for i in range(3)]
    assert [_wait(p) for p in pendings] == ["done"] * 3
    assert [p.result() for p in pendings] == [b"re:done r0", b"re:done r1", b"re:done r2"]


def test_get_rejects_ranges_outside_the_region(server: Server, client: NixlEngine) -> None:
    local = np.zeros(BLOCK, dtype=np.uint8)
    client.register(local.ctypes.data, local.nbytes, keepalive=local)
    link = client.connect(server.address)
    index = link.unpack_rkey(server.rkey, base=server.base, length=server.length)
    past_end = np.array([[local.ctypes.data, server.base + server.length - 8, 16, index]],
                        dtype=np.uint64)
    with pytest.raises(ValueError, match="outside remote region"):
        link.get(past_end)
    unregistered = np.array([[local.ctypes.data + BLOCK, server.base, 16, index]],
                            dtype=np.uint64)
    with pytest.raises(ValueError, match="not registered"):
        link.get(unregistered)
    with pytest.raises(IndexError):
        link.get(np.array([[local.ctypes.data, server.base, 16, index + 1]], dtype=np.uint64))


def test_addresses_of_other_transports_are_refused(client: NixlEngine) -> None:
    assert decode_address(encode_address("agent-a", b"\x00meta")) == ("agent-a", b"\x00meta")
    with pytest.raises(PeerUnreachable, match="not a NIXL engine address"):
        client.connect(b"\x01\x02 a UCX worker address")


def test_reply_to_a_vanished_requester_does_not_raise(tls: str) -> None:
    """A prefill answering a release after the decode died must not crash its responder."""
    requester = NixlEngine(name="gone-requester")
    answerer = NixlEngine(name="answerer", reads_expected=lambda: True)
    link = requester.connect(answerer.address)
    link.request(b"done r-gone")
    deadline = time.monotonic() + DEADLINE_S
    while not answerer.wait_requests(0.01) and time.monotonic() < deadline:
        requester.poll_requests()  # progress the requester's side of the send
    (incoming,) = answerer.poll_requests()
    assert incoming.payload == b"done r-gone"
    requester.close()
    incoming.reply(b"ok")  # must not raise (UCX may drop it or count it as failed)
    with pytest.raises(TransportError, match="already answered"):
        incoming.reply(b"ok")
    answerer.close()


_AGENT_AND_EXIT = ("from kvtransfer.transport.nixl import NixlEngine\n"
                   "NixlEngine(name='exit-probe').close()\n")


def test_a_process_that_made_a_nixl_agent_exits_cleanly() -> None:
    """Creating a NIXL agent must not crash the process at exit (libnl copies, see
    kvtransfer/transport/ucx_modules.py). When the machine has the system libefa, the same
    process with the EFA module forced back in (UCX_MODULES=all) crashes: the control shows
    the exit code would notice the crash."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    clean = subprocess.run([sys.executable, "-c", _AGENT_AND_EXIT], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stderr[-2000:]
    if ctypes.util.find_library("efa") is None:
        return  # nothing to control against: the module cannot load here at all
    forced = subprocess.run([sys.executable, "-c", _AGENT_AND_EXIT],
                            env={**env, "UCX_MODULES": "all"}, cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert forced.returncode == -11
