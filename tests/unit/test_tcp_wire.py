"""The sealed tcp wire's pure parts: hello MACs, op coalescing, bounds, scatter/gather I/O."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from kvtransfer.signing import Keyring
from kvtransfer.transport import tcp_wire as wire

U = np.uint64


def _arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=U)


def test_the_hello_accepts_any_secret_of_the_keyring_and_nothing_else() -> None:
    old, new, stranger = (Keyring((os.urandom(32),)) for _ in range(3))
    rotated = Keyring(new.secrets + old.secrets)  # the server mid-rotation
    inst, ns, nc = os.urandom(16), os.urandom(32), os.urandom(32)
    for client in (old, new):
        mac = wire.client_mac(client.wire_keys[0], inst, ns, nc)
        assert wire.accepted_key(rotated.wire_keys, inst, ns, nc, mac) == client.wire_keys[0]
    assert wire.accepted_key(rotated.wire_keys, inst, ns, nc,
                             wire.client_mac(stranger.wire_keys[0], inst, ns, nc)) is None
    # bound to the nonces and the instance: a recorded answer does not replay
    mac = wire.client_mac(new.wire_keys[0], inst, ns, nc)
    assert wire.accepted_key(rotated.wire_keys, inst, os.urandom(32), nc, mac) is None
    assert wire.accepted_key(rotated.wire_keys, os.urandom(16), ns, nc, mac) is None
    assert wire.accepted_key(rotated.wire_keys, inst, ns, nc, wire.ZERO_MAC) is None
    # the server's proof is not the client's (a reflected MAC proves nothing)
    assert wire.server_mac(new.wire_keys[0], inst, ns, nc) != mac
    assert new.wire_keys[0] not in new.secrets  # derived, never the secret itself


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    local = _arr(0, 10, 20, 100, 110)
    remote = _arr(500, 510, 900, 910, 920)
    n = _arr(10, 10, 10, 10, 10)
    lo, re, nb = wire.coalesce(local, remote, n)
    # 0-20 local is contiguous but remote jumps at 20; 100.. is contiguous on both
    assert lo.tolist() == [0, 20, 100]
    assert re.tolist() == [500, 900, 910]
    assert nb.tolist() == [20, 10, 20]
    assert int(nb.sum()) == int(n.sum())


def test_inside_checks_every_op_against_the_regions_and_refuses_wrapping() -> None:
    regions = [(1000, 100), (5000, 50)]
    addrs = _arr(1000, 1090, 1095, 5000, 999, 2 ** 64 - 8)
    sizes = _arr(100, 10, 10, 50, 2, 16)
    assert wire.inside(addrs, sizes, regions).tolist() == [True, True, False, True, False,
                                                           False]


def test_views_for_slices_the_right_region_and_refuses_a_range_leaving_it() -> None:
    a, b = bytearray(range(64)), bytearray(range(100, 164))
    regions = [(2000, memoryview(b)), (1000, memoryview(a))]
    views = wire.views_for(np.array([[1010, 4], [2060, 4], [1000, 1]], dtype=U), regions)
    assert [bytes(v) for v in views] == [bytes(range(10, 14)), bytes(range(160, 164)), b"\0"]
    with pytest.raises(ValueError):
        wire.views_for(np.array([[1060, 8]], dtype=U), regions)
    with pytest.raises(ValueError):
        wire.views_for(np.array([[10, 8]], dtype=U), regions)


def test_scattered_reads_and_gathered_writes_carry_every_byte_in_order() -> None:
    """More buffers than one sendmsg / recvmsg_into takes, of uneven sizes, through a socket
    small enough to force short writes and reads."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 3000, 3 * wire.IOV_BATCH + 7).tolist()
    src = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    dst = np.zeros_like(src)
    edges = np.cumsum([0, *sizes])
    src_views = [memoryview(src)[s:e] for s, e in zip(edges[:-1], edges[1:], strict=True)]
    dst_views = [memoryview(dst)[s:e] for s, e in zip(edges[:-1], edges[1:], strict=True)]
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sender = threading.Thread(target=wire.send_views, args=(left, b"HEAD", src_views))
    sender.start()
    assert wire.recv_exact(right, 4) == b"HEAD"
    wire.recv_views(right, dst_views)
    sender.join()
    assert np.array_equal(src, dst)
    left.close()
    with pytest.raises(wire.WireError):
        wire.recv_views(right, [memoryview(bytearray(1))])
    right.close()


def test_a_frame_past_its_cap_is_a_protocol_error() -> None:
    left, right = socket.socketpair()
    left.sendall(wire.pack_header(wire.REQ, 10 ** 6, 7))
    with pytest.raises(wire.WireError, match="max"):
        wire.read_frame(right, wire.MAX_REQUEST_BYTES)
    left.sendall(wire.pack_header(wire.REP, 3, 9))
    assert wire.read_frame(right, wire.MAX_REQUEST_BYTES) == (wire.REP, 3, 9)
    left.close()
    right.close()
