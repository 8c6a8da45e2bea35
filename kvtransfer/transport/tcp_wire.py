"""Wire format of the sealed TCP transport (``kvtransfer.transport.tcp``): the authenticated
hello, frames, read-op packing and bounds checks, scatter/gather socket I/O.

Why a transport of our own on tcp: UCX's tcp transport writes to and reads from whatever
address a peer's packet names (``uct_tcp_ep_handle_put_req`` and UCP's software RMA handlers
check no rkey or region), so any process that reaches a UCX tcp port owns the worker. Here
nothing one-sided is exposed: a peer must first prove it holds the cluster secret, and then it
can only *ask*; the serving engine checks every range against the memory it registered and
sends the bytes itself.

Hello (both directions, before any frame):
    server -> client  MAGIC, instance (16 B), server nonce Ns (32 B)
    client -> server  client nonce Nc (32 B), HMAC(k, "pdkv-c" | instance | Ns | Nc) (32 B)
    server -> client  HMAC(k, "pdkv-s" | instance | Nc | Ns) (32 B), or the connection closes
with k = HMAC(secret, "pdserve-kv-wire") for a cluster secret (``Keyring.wire_keys``; the
server accepts any secret of its keyring, the client proves the first of its own). An engine
without a keyring (a worker started ``--insecure``) sends and accepts zero MACs: still no byte
outside a registered region.
The instance (random per engine) makes a client refuse a different engine that reuses the
port after a restart.

Frames: header ``!BxxxIQ`` = kind, payload length, id; then the payload.
    PULL  client -> server  id = transfer id; payload = (remote address, length) pairs, u64 each
    REQ   client -> server  id = request id; payload = the request bytes
    DATA  server -> client  id = transfer id; payload = the bytes of every op, in order
    FAIL  server -> client  id = transfer id; payload = why the pull was refused (utf-8)
    REP   server -> client  id = request id; payload = the reply bytes
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import socket
import struct
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

MAGIC = b"PDKVTCP1"
INSTANCE_LEN = 16
NONCE_LEN = 32
MAC_LEN = 32
HELLO_LEN = len(MAGIC) + INSTANCE_LEN + NONCE_LEN

HEADER = struct.Struct("!BxxxIQ")
PULL, REQ, DATA, FAIL, REP = 1, 2, 3, 4, 5
MAX_REQUEST_BYTES = 64 * 1024
"""Largest REQ/REP/FAIL payload (lease messages are tens of bytes)."""
MAX_PULL_OPS = 1 << 20
"""Most (address, length) pairs in one PULL (16 MiB of ops)."""
IOV_BATCH = 512
"""Buffers handed to one sendmsg / recvmsg_into call (Linux allows IOV_MAX = 1024)."""
ZERO_MAC = bytes(MAC_LEN)


class WireError(Exception):
    """The peer broke the protocol, failed the hello, or the connection ended."""


def _mac(key: bytes | None, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``label`` and ``parts`` under ``key`` (zeros without a key)."""
    if key is None:
        return ZERO_MAC
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def client_mac(key: bytes | None, instance: bytes, server_nonce: bytes,
               client_nonce: bytes) -> bytes:
    """What the client sends to prove the secret (zeros without a key)."""
    return _mac(key, b"pdkv-c", instance, server_nonce, client_nonce)


def server_mac(key: bytes | None, instance: bytes, server_nonce: bytes,
               client_nonce: bytes) -> bytes:
    """What the server answers to prove the same secret (zeros without a key)."""
    return _mac(key, b"pdkv-s", instance, client_nonce, server_nonce)


def accepted_key(keys: Sequence[bytes], instance: bytes, server_nonce: bytes,
                 client_nonce: bytes, mac: bytes) -> bytes | None:
    """The key of ``keys`` whose client MAC is ``mac`` (constant-time compares), else None."""
    found = None
    for key in keys:
        if hmac.compare_digest(client_mac(key, instance, server_nonce, client_nonce), mac):
            found = key
    return found


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; WireError if the connection ends first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WireError("connection closed")
        got += k
    return bytes(buf)


def pack_header(kind: int, length: int, ident: int) -> bytes:
    """One frame header."""
    return HEADER.pack(kind, length, ident)


def read_frame(sock: socket.socket, max_payload: int) -> tuple[int, int, int]:
    """(kind, payload length, id) of the next frame; WireError past ``max_payload``."""
    kind, length, ident = HEADER.unpack(recv_exact(sock, HEADER.size))
    if length > max_payload:
        raise WireError(f"frame of kind {kind} with {length} payload bytes (max {max_payload})")
    return kind, length, ident


def coalesce(local: NDArray[np.uint64], remote: NDArray[np.uint64],
             nbytes: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], NDArray[np.uint64],
                                                  NDArray[np.uint64]]:
    """Merge each op into the previous one where both sides continue it contiguously (KV
    blocks with consecutive ids in one layer): fewer iovecs, same bytes in the same order."""
    if len(nbytes) < 2:
        return local, remote, nbytes
    joins = ((local[:-1] + nbytes[:-1]) == local[1:]) & ((remote[:-1] + nbytes[:-1]) == remote[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    sums = np.add.reduceat(nbytes, starts).astype(np.uint64)
    return local[starts], remote[starts], sums


def inside(addrs: NDArray[np.uint64], nbytes: NDArray[np.uint64],
           regions: Sequence[tuple[int, int]]) -> NDArray[np.bool_]:
    """Per op: does [addr, addr + nbytes) lie inside one of ``regions`` (base, length)?"""
    ok = np.zeros(len(addrs), dtype=bool)
    ends = addrs + nbytes
    wrapped = ends < addrs
    for base, length in regions:
        ok |= (addrs >= np.uint64(base)) & (ends <= np.uint64(base + length))
    return ok & ~wrapped


def memory_view(addr: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes of this process's memory at ``addr`` (memory
    the caller registered and keeps alive)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def views_for(ops: NDArray[np.uint64], regions: Sequence[tuple[int, memoryview]]
              ) -> list[memoryview]:
    """Slices of registered memory for (address, length) rows, each inside one region (the
    caller checked); ``regions`` are (base, view of the whole region)."""
    if not len(ops):
        return []
    ordered = sorted(regions, key=lambda r: r[0])
    bases = np.array([base for base, _ in ordered], dtype=np.uint64)
    which = np.searchsorted(bases, ops[:, 0], side="right") - 1
    if (which < 0).any():
        raise ValueError("a range starts below every registered region")
    offsets = (ops[:, 0] - bases[which]).tolist()
    out = []
    for k, off, n in zip(which.tolist(), offsets, ops[:, 1].tolist(), strict=True):
        view = ordered[k][1]
        if off + n > len(view):
            raise ValueError(f"range at offset {off}+{n} leaves its registered region")
        out.append(view[off: off + n])
    return out


def send_views(sock: socket.socket, head: bytes, views: Sequence[memoryview]) -> None:
    """Send ``head`` then every view, in order, with gathered writes."""
    pending: list[memoryview] = [memoryview(head)] if head else []
    i = 0
    while pending or i < len(views):
        while len(pending) < IOV_BATCH and i < len(views):
            pending.append(views[i])
            i += 1
        sent = sock.sendmsg(pending)
        pending = _advance(pending, sent)


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, in order, with scattered reads; WireError if the connection ends."""
    pending: list[memoryview] = []
    i = 0
    while pending or i < len(views):
        while len(pending) < IOV_BATCH and i < len(views):
            pending.append(views[i])
            i += 1
        got = sock.recvmsg_into(pending)[0]
        if got == 0:
            raise WireError("connection closed during a transfer")
        pending = _advance(pending, got)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes."""
    k = 0
    while k < len(views) and n >= len(views[k]):
        n -= len(views[k])
        k += 1
    rest = views[k:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest
