"""The sealed tcp transport between real processes, and the attack it closes.

A spawned server process registers a patterned "KV" region and also holds a secret that it
never registers (standing in for another tenant's KV or the keyring). The pytest process is
the client: a decode that holds the cluster secret, or a rogue peer that does not. The
negative control runs the same attack against our UCX engine over `UCX_TLS=tcp` (the wire
compose and Kubernetes shipped before) and reads the secret.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvtransfer.signing import Keyring
from kvtransfer.transport.tcp import TcpEngine

BLOCK = 32 << 10
NUM_BLOCKS = 64
SEED = 99
DEADLINE_S = 20.0  # generous bound; never asserted as a duration
CLUSTER = Keyring((secrets.token_bytes(32),))
SECRET_TEXT = b"tenant-b: the patient's diagnosis is ..." * 8


def _pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(conn: Any, transport: str, wire_keys: tuple[bytes, ...]) -> None:
    """Server process: a registered region, an unregistered secret, answer requests."""
    engine: Any
    if transport == "tcp":
        engine = TcpEngine(name="victim", keys=lambda: wire_keys)
    else:
        from kvtransfer.transport.ucx import UcxEngine

        engine = UcxEngine(name="victim", same_host=False)
    kv = _pattern(NUM_BLOCKS * BLOCK)
    secret = np.frombuffer(bytearray(SECRET_TEXT), dtype=np.uint8)
    region = engine.register(kv.ctypes.data, kv.nbytes, keepalive=kv)
    conn.send((engine.address, region.addr, region.length, region.rkey, secret.ctypes.data))
    while True:
        if conn.poll(0) and conn.recv() == "stop":
            break
        if not engine.wait_requests(0.05):
            continue
        for req in engine.poll_requests():
            req.reply(b"re:" + req.payload)
    engine.close()


@dataclass
class Victim:
    proc: Any
    conn: Any
    address: bytes
    base: int
    length: int
    rkey: bytes
    secret_addr: int

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _start(transport: str) -> Victim:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, transport, CLUSTER.wire_keys), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(60):
        proc.kill()
        pytest.fail("the server did not publish its address")
    return Victim(proc, parent, *parent.recv())


@pytest.fixture(scope="module")
def victim() -> Iterator[Victim]:
    server = _start("tcp")
    yield server
    server.stop()


@pytest.fixture
def member() -> Iterator[TcpEngine]:
    """A decode of the cluster: it holds the secret."""
    engine = TcpEngine(name="member", keys=lambda: CLUSTER.wire_keys)
    yield engine
    engine.close()


def _landing(engine: TcpEngine, nbytes: int) -> np.ndarray:
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    return buf


def test_a_member_pulls_scattered_blocks_exactly_and_talks_leases(victim: Victim,
                                                                  member: TcpEngine) -> None:
    dst = _landing(member, NUM_BLOCKS * BLOCK)
    link = member.connect(victim.address)
    region = link.unpack_rkey(victim.rkey, base=victim.base, length=victim.length)
    # blocks in runs of 4, scattered (coalesced on the wire, landed in order)
    order = np.random.default_rng(3).permutation(NUM_BLOCKS // 4)
    remote = np.array([b * 4 + k for b in order for k in range(4)], dtype=np.uint64)
    ops = np.stack([dst.ctypes.data + np.arange(NUM_BLOCKS, dtype=np.uint64) * BLOCK,
                    victim.base + remote * BLOCK, np.full(NUM_BLOCKS, BLOCK),
                    np.full(NUM_BLOCKS, region)], axis=1).astype(np.uint64)
    pull = link.get(ops)
    assert pull.wait(DEADLINE_S) == "done", pull.error
    want = _pattern(NUM_BLOCKS * BLOCK).reshape(NUM_BLOCKS, BLOCK)[remote.astype(np.int64)]
    assert np.array_equal(dst.reshape(NUM_BLOCKS, BLOCK), want)
    reply = link.request(b"done req-1 token")
    assert reply.wait(DEADLINE_S) == "done", reply.error
    assert reply.result() == b"re:done req-1 token"


def test_a_peer_without_the_cluster_secret_gets_no_connection(victim: Victim) -> None:
    rogue = TcpEngine(name="rogue", keys=lambda: Keyring((secrets.token_bytes(32),)).wire_keys)
    keyless = TcpEngine(name="keyless")
    try:
        for engine in (rogue, keyless):
            with pytest.raises(Exception, match="connection closed|prove"):
                engine.connect(victim.address)
    finally:
        rogue.close()
        keyless.close()


def test_a_member_cannot_read_memory_it_was_never_given(victim: Victim, member: TcpEngine
                                                        ) -> None:
    """The attack UCX's tcp emulation allows (below), refused: the server sends only ranges
    inside its registered memory, whatever the client claims about the region."""
    dst = _landing(member, len(SECRET_TEXT))
    link = member.connect(victim.address)
    unchecked = link.unpack_rkey(victim.rkey)  # no bounds on our side: only the server checks
    ops = np.array([[dst.ctypes.data, victim.secret_addr, len(SECRET_TEXT), unchecked]],
                   dtype=np.uint64)
    pull = link.get(ops)
    assert pull.wait(DEADLINE_S) == "error"
    assert "outside the registered memory" in (pull.error or "")
    assert not dst.any()
    # the link and the server live on: a range inside the region is still served
    inside = np.array([[dst.ctypes.data, victim.base, len(SECRET_TEXT), unchecked]],
                      dtype=np.uint64)
    pull = link.get(inside)
    assert pull.wait(DEADLINE_S) == "done", pull.error
    assert bytes(dst) == _pattern(len(SECRET_TEXT)).tobytes()


def test_ucx_over_tcp_lets_any_peer_read_memory_it_was_never_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: our UCX engine over `UCX_TLS=tcp` serves the same read, in software,
    from whatever address the packet names (security review finding 1)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    server = _start("ucx")
    from kvtransfer.transport.ucx import UcxEngine

    attacker = UcxEngine(name="attacker", same_host=False)
    try:
        dst = np.zeros(len(SECRET_TEXT), dtype=np.uint8)
        attacker.register(dst.ctypes.data, dst.nbytes, keepalive=dst)
        peer = attacker.connect(server.address)
        # the region's rkey, published in the handshake; the bounds are the attacker's own
        # claim (checked on its side only), so it names the secret's
        rkey = peer.unpack_rkey(server.rkey, base=server.secret_addr, length=len(SECRET_TEXT))
        ops = np.array([[dst.ctypes.data, server.secret_addr, len(SECRET_TEXT), rkey]],
                       dtype=np.uint64)
        peer.get(ops).wait(DEADLINE_S)
        assert bytes(dst) == SECRET_TEXT
    finally:
        attacker.close()
        server.stop()


def test_abort_stops_writes_and_a_dead_server_fails_the_pull(member: TcpEngine) -> None:
    server = _start("tcp")
    try:
        dst = _landing(member, NUM_BLOCKS * BLOCK)
        link = member.connect(server.address)
        region = link.unpack_rkey(server.rkey, base=server.base, length=server.length)
        ops = np.array([[dst.ctypes.data, server.base, NUM_BLOCKS * BLOCK, region]],
                       dtype=np.uint64)
        assert link.get(ops).wait(DEADLINE_S) == "done"
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.join(10)
        dst[:] = 0
        pull = link.get(ops)
        assert pull.wait(DEADLINE_S) == "error"
        assert link.failed
        link.abort()  # idempotent on a failed link; nothing lands afterwards
        assert not dst.any()
        assert link.request(b"x").poll() == "error"
    finally:
        server.stop()


def test_requests_beyond_the_cap_and_bad_ops_are_refused_locally(victim: Victim,
                                                                 member: TcpEngine) -> None:
    link = member.connect(victim.address)
    region = link.unpack_rkey(victim.rkey, base=victim.base, length=victim.length)
    with pytest.raises(ValueError, match="max"):
        link.request(b"x" * (64 * 1024 + 1))
    with pytest.raises(ValueError, match="outside its remote region"):
        link.get(np.array([[0, victim.base + victim.length - 8, 16, region]], dtype=np.uint64))
    dst = np.zeros(16, dtype=np.uint8)  # not registered with the member engine
    with pytest.raises(ValueError, match="outside this engine's registered memory"):
        link.get(np.array([[dst.ctypes.data, victim.base, 16, region]], dtype=np.uint64))
