"""The transport between real processes (spawned server, pytest process as client).

Runs over UCX's default transports and over `UCX_TLS=tcp` (RMA emulated in software, so the
server's progress thread must serve it). Gets run over both read paths: "pvm" (same host,
process_vm_readv, chosen when `connect` gets the server's locality) and "ucx" (forced with
connecting without the server's locality).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kernels import native
from kvtransfer.transport import (
    PeerUnreachable,
    TransferTimeout,
    TransportError,
    UcxEngine,
)

BLOCK = 32 << 10
NUM_BLOCKS = 256  # 8 MiB served region
SEED = 1234
DEADLINE_S = 20.0  # generous bound; never asserted as a duration


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(conn: Any, mode: str) -> None:
    """Server process: register a patterned buffer, ship its coordinates, answer requests."""
    engine = UcxEngine(name="test-server")
    buf = _pattern(NUM_BLOCKS * BLOCK, SEED)
    region = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    conn.send((engine.address, engine.locality, region.addr, region.length, region.rkey))
    while True:
        if conn.poll(0) and conn.recv() == "stop":
            break
        if not engine.wait_requests(0.05):
            continue
        for req in engine.poll_requests():
            if mode == "echo":
                req.reply(b"re:" + req.payload)
            else:  # "silent": report receipt, never reply
                conn.send(("got", req.payload))
    engine.close()
    conn.send("closed")


@dataclass
class Server:
    proc: Any
    conn: Any
    address: bytes
    locality: bytes
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


def _start_server(mode: str) -> Server:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, mode), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(60):
        proc.kill()
        pytest.fail("server did not publish its UCX address")
    address, locality, base, length, rkey = parent.recv()
    return Server(proc, parent, address, locality, base, length, rkey)


@pytest.fixture(scope="module")
def tls(ucx_tls: str) -> str:
    """UCX_TLS for both processes (set before any UCX context exists in either)."""
    return ucx_tls


@pytest.fixture(scope="module")
def echo_server(tls: str) -> Iterator[Server]:
    server = _start_server("echo")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tls: str) -> Iterator[UcxEngine]:
    engine = UcxEngine(name=f"test-client-{tls}")
    yield engine
    engine.close()


def _landing(engine: UcxEngine, nbytes: int) -> np.ndarray:
    """Zeroed local memory registered with `engine` (gets may land only in registered memory)."""
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    return buf


def _scattered_ops(local_base: int, remote_base: int, rkey: int, remote_blocks: np.ndarray,
                   shift: int = 0) -> np.ndarray:
    """One op per run of blocks contiguous on both sides (local block i <- remote_blocks[i])."""
    ops = []
    i = 0
    while i < len(remote_blocks):
        j = i + 1
        while j < len(remote_blocks) and remote_blocks[j] == remote_blocks[j - 1] + 1:
            j += 1
        ops.append((local_base + i * BLOCK, remote_base + int(remote_blocks[i]) * BLOCK + shift,
                    (j - i) * BLOCK, rkey))
        i = j
    return np.array(ops, dtype=np.uint64)


def _remote_block_ids(n: int) -> np.ndarray:
    """A permutation with contiguous runs, like a paged KV cache after churn."""
    rng = np.random.default_rng(7)
    runs = np.array_split(rng.permutation(NUM_BLOCKS // 4), 16)
    ids = [b for run in runs for first in run for b in range(first * 4, first * 4 + 4)]
    return np.array(ids[:n], dtype=np.int64)


def _connect(client: UcxEngine, server: Server, path: str) -> Any:
    """Connect with the server's locality for "pvm"; without it (UCX only) for "ucx"."""
    peer = client.connect(server.address, server.locality if path == "pvm" else None)
    assert peer.path == path, peer.path_reason
    if path == "ucx":
        assert peer.path_reason == "no locality given"
    return peer


@pytest.mark.parametrize("path", ["pvm", "ucx"])
def test_get_pulls_scattered_runs_exactly(echo_server: Server, client: UcxEngine,
                                          path: str) -> None:
    n = 128
    remote_ids = _remote_block_ids(n)
    dst = _landing(client, n * BLOCK)
    peer = _connect(client, echo_server, path)
    rk = peer.unpack_rkey(echo_server.rkey, base=echo_server.base, length=echo_server.length)
    ops = _scattered_ops(dst.ctypes.data, echo_server.base, rk, remote_ids)
    assert 1 < len(ops) < n  # runs were coalesced, and there is more than one

    transfer = peer.get(ops)
    assert transfer.path == path
    transfer.wait(DEADLINE_S)

    src = _pattern(NUM_BLOCKS * BLOCK, SEED).reshape(NUM_BLOCKS, BLOCK)
    expected = src[remote_ids].reshape(-1)
    assert np.array_equal(dst, expected)

    # Negative control: the same pull from one block further on lands different bytes, and the
    # comparison above would have caught it.
    dst[:] = 0
    shifted = _scattered_ops(dst.ctypes.data, echo_server.base, rk,
                             np.minimum(remote_ids, NUM_BLOCKS - 2), shift=BLOCK)
    transfer = peer.get(shifted)
    transfer.wait(DEADLINE_S)
    assert transfer.poll() == "done" and transfer.result() == b"" and transfer.error is None
    assert not np.array_equal(dst, expected)
    assert np.array_equal(dst[:BLOCK], src[min(int(remote_ids[0]), NUM_BLOCKS - 2) + 1])


def test_get_rejects_malformed_ops(echo_server: Server, client: UcxEngine) -> None:
    peer = client.connect(echo_server.address)
    with pytest.raises(ValueError):
        peer.get(np.zeros((2, 3), dtype=np.uint64))
    with pytest.raises(ValueError):
        peer.get(np.zeros((2, 4), dtype=np.float64))
    with pytest.raises(IndexError):  # no rkey unpacked on this endpoint yet
        peer.get(np.array([[1, 1, 8, 0]], dtype=np.uint64))


@pytest.mark.parametrize("path", ["pvm", "ucx"])
def test_get_rejects_ranges_outside_the_region(echo_server: Server, client: UcxEngine,
                                               path: str) -> None:
    peer = _connect(client, echo_server, path)
    rk = peer.unpack_rkey(echo_server.rkey, base=echo_server.base, length=echo_server.length)
    dst = _landing(client, 2 * BLOCK)
    end = echo_server.base + echo_server.length
    for remote in (end - BLOCK + 1, echo_server.base - 8):
        with pytest.raises(ValueError, match="outside region"):
            peer.get(np.array([[dst.ctypes.data, remote, BLOCK, rk]], dtype=np.uint64))
    peer.get(np.array([[dst.ctypes.data, end - BLOCK, BLOCK, rk]], dtype=np.uint64)).wait(
        DEADLINE_S)  # the last block is inside
    assert np.array_equal(dst[:BLOCK], _pattern(NUM_BLOCKS * BLOCK, SEED)[-BLOCK:])
    with pytest.raises(ValueError):
        peer.unpack_rkey(echo_server.rkey, base=echo_server.base)


@pytest.mark.parametrize("path", ["pvm", "ucx"])
def test_a_get_into_unregistered_local_memory_is_refused(echo_server: Server, client: UcxEngine,
                                                         path: str) -> None:
    """Security review finding 19: a get's destination must lie inside one region registered
    with this engine, on both read paths; before, an unregistered destination was still posted
    to UCX and process_vm_readv wrote wherever it pointed (one bad local block id would do)."""
    peer = _connect(client, echo_server, path)
    rk = peer.unpack_rkey(echo_server.rkey, base=echo_server.base, length=echo_server.length)
    landing = _landing(client, 2 * BLOCK)
    stray = np.zeros(2 * BLOCK, dtype=np.uint8)  # never registered
    good = (landing.ctypes.data, echo_server.base, BLOCK, rk)
    for bad in ((stray.ctypes.data, echo_server.base, BLOCK, rk),
                (landing.ctypes.data + BLOCK + 1, echo_server.base, BLOCK, rk),  # past its end
                (landing.ctypes.data - 8, echo_server.base, BLOCK, rk)):  # before its start
        with pytest.raises(ValueError, match="outside every registered region"):
            peer.get(np.array([good, bad], dtype=np.uint64))  # refused whole: nothing posted
    time.sleep(0.05)  # a write posted anyway would have landed by now
    assert not stray.any() and not landing.any()
    # Control: the same ops with the destination inside the region land the bytes.
    peer.get(np.array([good, (landing.ctypes.data + BLOCK, echo_server.base + BLOCK, BLOCK, rk)],
                      dtype=np.uint64)).wait(DEADLINE_S)
    assert np.array_equal(landing, _pattern(2 * BLOCK, SEED))
    peer.get(np.zeros((0, 4), dtype=np.uint64)).wait(DEADLINE_S)  # nothing to check, nothing done


def test_an_rkey_is_unpacked_only_with_its_region_bounds(echo_server: Server,
                                                        client: UcxEngine) -> None:
    """Security review finding 19: without base and length an rkey used to unpack unchecked,
    turning the remote range check off for every get through it."""
    peer = client.connect(echo_server.address)
    with pytest.raises(ValueError, match="base and length"):
        peer.unpack_rkey(echo_server.rkey)
    with pytest.raises(TypeError, match="base"):  # the extension itself requires them too
        peer._c.unpack_rkey(echo_server.rkey)
    for base, length in ((0, echo_server.length), (echo_server.base, 0), (2**64 - 8, 16)):
        with pytest.raises(ValueError, match="base and length"):
            peer._c.unpack_rkey(echo_server.rkey, base, length)
    # Control: with them it unpacks, and gets through it are held to that region.
    rk = peer.unpack_rkey(echo_server.rkey, base=echo_server.base, length=BLOCK)
    dst = _landing(client, 2 * BLOCK)
    with pytest.raises(ValueError, match="outside region"):
        peer.get(np.array([[dst.ctypes.data, echo_server.base + 1, BLOCK, rk]], dtype=np.uint64))
    peer.get(np.array([[dst.ctypes.data, echo_server.base, BLOCK, rk]],
                      dtype=np.uint64)).wait(DEADLINE_S)
    assert np.array_equal(dst[:BLOCK], _pattern(BLOCK, SEED))


def test_locality_selects_the_path(echo_server: Server, client: UcxEngine) -> None:
    loc = bytearray(echo_server.locality)
    assert len(loc) > 0 and len(client.locality) == len(loc)
    assert client.connect(echo_server.address).path == "ucx"  # no locality: UCX
    assert client.connect(echo_server.address, b"").path == "ucx"

    wrong_nonce = bytearray(loc)
    wrong_nonce[-1] ^= 0xFF  # same host and pid, but not that engine: the probe must refuse it
    peer = client.connect(echo_server.address, bytes(wrong_nonce))
    assert peer.path == "ucx" and "identity mismatch" in (peer.path_reason or "")
    rk = peer.unpack_rkey(echo_server.rkey, base=echo_server.base, length=echo_server.length)
    dst = _landing(client, BLOCK)
    transfer = peer.get(np.array([[dst.ctypes.data, echo_server.base, BLOCK, rk]],
                                 dtype=np.uint64))
    transfer.wait(DEADLINE_S)  # the fallback still reads, over UCX
    assert transfer.path == "ucx"
    assert np.array_equal(dst, _pattern(BLOCK, SEED))

    other_host = bytearray(loc)
    other_host[8:12] = b"XXXX"  # boot id
    peer = client.connect(echo_server.address, bytes(other_host))
    assert (peer.path, peer.path_reason) == ("ucx", "different host")

    with UcxEngine(name="no-same-host", same_host=False) as engine:
        assert engine.locality == b""
        peer = engine.connect(echo_server.address, echo_server.locality)
        assert (peer.path, peer.path_reason) == ("ucx", "same-host path off (same_host=False)")


def _big_read(peer: Any, server: Server, dst: np.ndarray, times: int) -> np.ndarray:
    """Ops reading the whole served region `times` over into dst (same bytes each time)."""
    rk = peer.unpack_rkey(server.rkey, base=server.base, length=server.length)
    row = (dst.ctypes.data, server.base, server.length, rk)
    return np.array([row] * times, dtype=np.uint64)


def test_pvm_peer_killed_midway_errors(tls: str, client: UcxEngine) -> None:
    server = _start_server("silent")
    try:
        peer = _connect(client, server, "pvm")
        dst = _landing(client, NUM_BLOCKS * BLOCK)
        ops = _big_read(peer, server, dst, 512)  # 4 GiB of reads: far longer than a kill takes
        transfer = peer.get(ops)
        assert transfer.poll() == "pending"
        os.kill(server.proc.pid, signal.SIGKILL)
        with pytest.raises(PeerUnreachable, match="gone"):
            transfer.wait(DEADLINE_S)
        assert transfer.poll() == "error" and peer.failed
        server.proc.join(10)
        with pytest.raises(PeerUnreachable):
            peer.get(ops[:1])
        peer.abort()
    finally:
        server.stop()


def test_pvm_abort_stops_writes(echo_server: Server, client: UcxEngine) -> None:
    peer = _connect(client, echo_server, "pvm")
    dst = _landing(client, NUM_BLOCKS * BLOCK)
    transfer = peer.get(_big_read(peer, echo_server, dst, 512))
    with pytest.raises(TransferTimeout):
        transfer.wait(0.01)  # aborts the peer
    assert peer.closed and transfer.poll() == "error"
    assert "aborted" in (transfer.error or "")
    dst[:] = 0  # nothing may land after abort() returned
    time.sleep(0.05)
    assert not dst.any()
    with pytest.raises(TransportError):
        peer.get(np.zeros((0, 4), dtype=np.uint64))


def test_request_reply_round_trips(echo_server: Server, client: UcxEngine) -> None:
    peer = client.connect(echo_server.address)
    payloads = [b"", b"release:req-1", bytes(range(256)) * 400]  # last one spans many fragments
    transfers = [peer.request(p) for p in payloads]
    for payload, transfer in zip(payloads, transfers, strict=True):
        transfer.wait(DEADLINE_S)
        assert transfer.result() == b"re:" + payload
    for i in range(20):
        assert_reply = peer.request(b"ping %d" % i)
        assert_reply.wait(DEADLINE_S)
        assert assert_reply.result() == b"re:ping %d" % i


def test_a_requester_that_reconnected_is_still_answered(echo_server: Server) -> None:
    """The server answers over its own endpoint to the requester's address, opened on the first
    request and kept (security review finding 17): a requester that aborted its peer (a timed-out
    pull does) and connected again, with either endpoint layout, is still answered."""
    with UcxEngine(name="reconnecting") as engine:
        for i, locality in enumerate((echo_server.locality, None, echo_server.locality)):
            peer = engine.connect(echo_server.address, locality)
            transfer = peer.request(b"again %d" % i)
            transfer.wait(DEADLINE_S)
            assert transfer.result() == b"re:again %d" % i
            peer.abort()


def test_timeout_aborts_peer_and_errors_outstanding_ops(tls: str, client: UcxEngine) -> None:
    server = _start_server("silent")
    try:
        peer = client.connect(server.address)
        first = peer.request(b"never answered")
        second = peer.request(b"neither")
        with pytest.raises(TransferTimeout):
            first.wait(0.5)
        assert peer.closed
        assert second.poll() == "error" and second.error
        with pytest.raises(TransportError):
            peer.request(b"after abort")
    finally:
        server.stop()


def test_peer_death_fails_pending_transfer(tls: str, client: UcxEngine) -> None:
    server = _start_server("silent")
    try:
        peer = client.connect(server.address)
        rk = peer.unpack_rkey(server.rkey, base=server.base, length=server.length)
        dst = _landing(client, BLOCK)
        peer.get(np.array([[dst.ctypes.data, server.base, BLOCK, rk]], dtype=np.uint64)).wait(
            DEADLINE_S)  # the connection is fully up
        pending = peer.request(b"die first")
        assert server.conn.poll(DEADLINE_S), "server never received the request"
        assert server.conn.recv() == ("got", b"die first")
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.join(10)

        with pytest.raises(PeerUnreachable):
            pending.wait(DEADLINE_S)
        assert pending.poll() == "error"
        assert peer.failed
        # Security review finding 17: the extension itself refuses a get on a failed peer (it
        # reads `failed` under the lock its error callback takes), not only the Python layer.
        ops = np.array([[dst.ctypes.data, server.base, BLOCK, rk]], dtype=np.uint64)
        with pytest.raises(PeerUnreachable, match="peer failed"):
            peer.get(ops)
        with pytest.raises(native.load().NativeTransportError, match="peer failed"):
            peer._c.get(ops)
        with pytest.raises(PeerUnreachable, match="peer failed"):
            peer.request(b"after the death")
        peer.abort()
    finally:
        server.stop()


def test_reply_to_dead_requester_is_a_noop(tls: str) -> None:
    """Server side of a dead client: replying logs and returns, later requests still work."""
    ctx = mp.get_context("spawn")
    server = _start_server("echo")
    requester = ctx.Process(target=_request_then_die, args=(server.address,), daemon=True)
    try:
        requester.start()
        requester.join(60)
        assert requester.exitcode == -signal.SIGKILL
        # The echo server replied (or will) to a dead requester; it must stay healthy.
        with UcxEngine(name="second-client") as engine:
            transfer = engine.connect(server.address).request(b"still alive?")
            transfer.wait(DEADLINE_S)
            assert transfer.result() == b"re:still alive?"
    finally:
        server.stop()
        if requester.is_alive():
            requester.kill()


def _request_then_die(address: bytes) -> None:
    engine = UcxEngine(name="doomed")
    engine.connect(address).request(b"answer me when I am gone")
    engine.wait_requests(0.2)  # let the progress thread send it
    os.kill(os.getpid(), signal.SIGKILL)


def test_close_with_live_transfers_is_safe(echo_server: Server) -> None:
    engine = UcxEngine(name="short-lived")
    peer = engine.connect(echo_server.address)
    transfer = peer.request(b"x" * 1000)
    engine.close()
    engine.close()  # idempotent
    assert transfer.poll() in ("done", "error")
    with pytest.raises(TransportError):
        transfer.wait(1.0) if transfer.poll() == "error" else peer.request(b"y")
    with pytest.raises(TransportError):
        engine.register(1 << 20, 4096)


def test_request_ids_cannot_be_guessed(tls: str) -> None:
    """Security review finding 8: replies are matched by request id, so a peer that could guess
    pending ids could answer a decode's release with its own "ok". Ids are 64 random bits, not
    1, 2, 3..."""
    with UcxEngine(name="test-ids-server") as server, UcxEngine(name="test-ids-client") as client:
        peer = client.connect(server.address)
        sent = [peer.request(b"done %d" % i) for i in range(32)]
        got: list[Any] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < len(sent) and time.monotonic() < deadline:
            server.wait_requests(0.1)
            got += server.poll_requests()
        ids = [r._req_id for r in got]
        assert len(ids) == 32 and len(set(ids)) == 32 and 0 not in ids
        assert max(ids) > 2**40  # sequential ids would all be below 33
        assert sum(b - a == 1 for a, b in zip(ids, ids[1:], strict=False)) == 0
        for request in got:
            request.reply(b"ok")
        for transfer in sent:  # control: each reply still finds its own request
            transfer.wait(DEADLINE_S)
            assert transfer.result() == b"ok"


def test_a_request_flood_is_dropped_past_the_queue_cap(tls: str) -> None:
    """Security review finding 15: requests nobody drains (a peer flooding the prefill's control
    channel) are queued up to 16,384, then dropped and counted, never grown without bound."""
    cap, extra = 16384, 200
    with UcxEngine(name="test-flood-server") as server, \
            UcxEngine(name="test-flood-client") as client:
        peer = client.connect(server.address)
        dropped = server.dropped_messages
        transfers = [peer.request(b"renew x y") for _ in range(cap + extra)]
        deadline = time.monotonic() + 60
        while server.dropped_messages - dropped < extra and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.dropped_messages - dropped == extra
        assert len(server.poll_requests()) == cap
        peer.abort()
        del transfers


def _take_requests(server: UcxEngine, n: int) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < n and time.monotonic() < deadline:
        server.wait_requests(0.1)
        got += server.poll_requests()
    assert len(got) == n
    return got


def test_a_reply_not_vouched_for_opens_no_endpoint(tls: str) -> None:
    """Security review finding 15: the prefill answers over an endpoint it creates to the
    address the request names, so a reply the responder does not vouch for (no lease proven)
    goes out only over an endpoint it already holds to that address, else it is dropped and
    counted: an unproven request cannot make it connect anywhere. Control: vouched, the same
    requester is answered and its endpoint kept; then unvouched replies reach it too."""
    with UcxEngine(name="test-vouch-server") as server, \
            UcxEngine(name="test-vouch-client") as client:
        peer = client.connect(server.address)
        stranger = peer.request(b"done made-up")
        (request,) = _take_requests(server, 1)
        request.reply(b"ok", vouched=False)
        assert server.unanswered_strangers == 1 and server.reply_peers == (0, 0)
        assert server.failed_replies == 0

        proven = peer.request(b"done real")  # control
        (request,) = _take_requests(server, 1)
        request.reply(b"ok", vouched=True)
        proven.wait(DEADLINE_S)
        assert proven.result() == b"ok" and server.reply_peers == (1, 0)
        known = peer.request(b"done made-up-2")
        (request,) = _take_requests(server, 1)
        request.reply(b"expired", vouched=False)
        known.wait(DEADLINE_S)
        assert known.result() == b"expired" and server.unanswered_strangers == 1
        assert stranger.poll() == "pending"
        peer.abort()


@pytest.mark.parametrize("path", ["pvm", "ucx"])
def test_two_engines_that_request_from_each_other_are_both_answered(path: str) -> None:
    """Flex workers pull from each other: B requests from A (A answers over its reply
    endpoint), then A requests from B. UCX pairs the endpoints two workers open to each other
    in creation order; on the pvm path A's data endpoint went without error handling and was
    paired with one of B's that had it ("asymmetric endpoint configuration"), so A's requests
    hung until their timeout (a 20 s release stall in the adaptive cluster). Both directions
    answer, before and after the reversal."""
    def answer(engine: UcxEngine, stop: threading.Event) -> None:
        while not stop.is_set():
            engine.wait_requests(0.05)
            for req in engine.poll_requests():
                req.reply(b"re:" + req.payload, vouched=True)

    stop = threading.Event()
    with UcxEngine(name="flex-a") as a, UcxEngine(name="flex-b") as b:
        for engine in (a, b):
            _landing(engine, BLOCK)  # some registered memory, as a worker has (kept alive)
        threads = [threading.Thread(target=answer, args=(e, stop), daemon=True) for e in (a, b)]
        for t in threads:
            t.start()
        try:
            b_to_a = b.connect(a.address, a.locality if path == "pvm" else None)
            a_to_b = None
            for i, sender in enumerate(("b", "b", "a", "b", "a")):
                if sender == "a" and a_to_b is None:
                    a_to_b = a.connect(b.address, b.locality if path == "pvm" else None)
                peer = b_to_a if sender == "b" else a_to_b
                assert peer is not None and peer.path == path
                transfer = peer.request(b"%s %d" % (sender.encode(), i))
                transfer.wait(DEADLINE_S)  # the failure was a hang, not a slow answer
                assert transfer.result() == b"re:%s %d" % (sender.encode(), i)
        finally:
            stop.set()
            for t in threads:
                t.join(5)
