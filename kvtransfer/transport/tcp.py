"""Sealed TCP transport: authenticated connections and server-checked pulls, no one-sided
access (``ConnectorConfig.transport = "tcp"``; the wire is in ``tcp_wire``).

The shipped inter-host wire. UCX over tcp serves RMA in software with no region check, so a
peer that reaches a UCX port can read or write any byte of the worker; here a peer must prove
the cluster secret before its first frame, and it can then only ask for ranges: the serving
engine checks each against the memory it registered and sends the bytes itself (gathered
``sendmsg`` straight from the KV blocks, received with scattered ``recvmsg_into`` straight into
the decode's blocks, so no copy besides the kernel's). The lease protocol (release, renew) runs
as requests on the same authenticated connection, so a reply can only come from the engine the
request went to.

Threads: one acceptor per engine; one thread per accepted connection (reads its frames, serves
its pulls in order); one reader per outgoing link (lands DATA in local memory, resolves
pendings). ``Link.abort`` shuts the socket and joins the reader, so once it returns no byte of
that link can still land. Engines are thread-safe (the connector uses one from two threads).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from kvtransfer.errors import PeerUnreachable, TransportError
from kvtransfer.transport import tcp_wire as wire

if TYPE_CHECKING:
    from numpy.typing import NDArray

logger = logging.getLogger(__name__)

TransferState = Literal["pending", "done", "error"]
IN_QUEUE_MAX = 16384
"""Requests queued for the responder at most; a flood beyond is dropped and counted."""
MAX_CONNECTIONS = 256
"""Accepted connections at most (each has a thread); more are closed at once."""
HELLO_TIMEOUT_S = 5.0
"""A connection that has not finished the hello by then is closed."""
CONNECT_TIMEOUT_S = 5.0

KeySource = Callable[[], Sequence[bytes]]
"""Returns the hello keys now (``Keyring.wire_keys``: the first proves, any one verifies);
empty: no keyring."""


class TcpRegion:
    """Memory registered for peers' pulls; the address blob already names nothing secret."""

    __slots__ = ("addr", "length", "rkey", "_keepalive")

    def __init__(self, addr: int, length: int, keepalive: object) -> None:
        self.addr = addr
        self.length = length
        self.rkey = b""
        """Nothing to ship: the serving engine checks ranges itself."""
        self._keepalive = keepalive


class TcpPending:
    """Completion handle of a pull or a request."""

    __slots__ = ("_state", "_result", "_error", "_event")

    def __init__(self) -> None:
        self._state: TransferState = "pending"
        self._result = b""
        self._error: str | None = None
        self._event = threading.Event()

    def poll(self) -> TransferState:
        """Non-blocking state."""
        return self._state

    def wait(self, timeout_s: float) -> TransferState:
        """Block up to ``timeout_s`` for an outcome; the state then."""
        self._event.wait(timeout_s)
        return self._state

    def result(self) -> bytes:
        """The reply of a request (b"" for a pull); raises unless done."""
        if self._state != "done":
            raise TransportError(f"transfer is {self._state}: {self._error or ''}".rstrip(": "))
        return self._result

    @property
    def error(self) -> str | None:
        """Why it failed, else None."""
        return self._error

    def _finish(self, result: bytes = b"", error: str | None = None) -> None:
        if self._state != "pending":
            return
        self._result, self._error = result, error
        self._state = "error" if error is not None else "done"
        self._event.set()


class _Incoming:
    """A request received on one authenticated connection; answered once, on it."""

    __slots__ = ("payload", "_conn", "_ident")

    def __init__(self, payload: bytes, conn: _ServerConn, ident: int) -> None:
        self.payload = payload
        self._conn = conn
        self._ident = ident

    def reply(self, payload: bytes, *, vouched: bool = True) -> None:
        """Send the answer; a requester that is gone is logged, not raised. ``vouched`` does not
        matter here: the answer goes back on the authenticated connection the request came
        on, never to an address the request names."""
        self._conn.send_frame(wire.REP, self._ident, payload)


class TcpLink:
    """An authenticated connection to one remote engine (``TcpEngine.connect``)."""

    def __init__(self, engine: TcpEngine, sock: socket.socket, label: str) -> None:
        self._engine = engine
        self._sock = sock
        self._label = label
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[TcpPending, list[memoryview] | None, int]] = {}
        self._next_id = int.from_bytes(os.urandom(4), "big")
        self._regions: list[tuple[int, int] | None] = []
        self._failed = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"pdserve-kv-tcp-link-{label}")
        self._reader.start()

    @property
    def failed(self) -> bool:
        """True once the connection ended or was aborted (the caller reconnects)."""
        return self._failed

    @property
    def path(self) -> str:
        """Always "tcp"."""
        return "tcp"

    @property
    def path_reason(self) -> str | None:
        """None: there is no same-host path to fall back from."""
        return None

    def unpack_rkey(self, packed: bytes, *, base: int | None = None,
                    length: int | None = None) -> int:
        """Index of a remote region for column 3 of ``get`` ops; with ``base``/``length`` every
        op is checked here too (the server checks regardless)."""
        if (base is None) != (length is None):
            raise ValueError("give both base and length, or neither")
        self._regions.append(None if base is None or length is None else (int(base), int(length)))
        return len(self._regions) - 1

    def get(self, ops: NDArray[np.int64] | NDArray[np.uint64]) -> TcpPending:
        """Pull (n, 4) rows (local addr, remote addr, nbytes, region index): the remote engine
        checks the ranges and sends them; they land straight in local registered memory."""
        given = np.asarray(ops)
        if given.ndim != 2 or given.shape[1] != 4:
            raise ValueError("ops must be an (n, 4) array")
        if given.dtype.kind == "i" and (given < 0).any():
            raise ValueError("negative address, length or region index in ops")
        all_rows: NDArray[np.uint64] = given.astype(np.uint64)
        rows: NDArray[np.uint64] = all_rows[all_rows[:, 2] > 0]
        for index in np.unique(rows[:, 3]).tolist():
            if index >= len(self._regions):
                raise ValueError(f"region index {index} was never unpacked")
            region = self._regions[int(index)]
            sel = rows[:, 3] == index
            if region is not None and not wire.inside(rows[sel, 1], rows[sel, 2], [region]).all():
                raise ValueError("an op reads outside its remote region")
        local, remote, nbytes = wire.coalesce(rows[:, 0], rows[:, 1], rows[:, 2])
        if not wire.inside(local, nbytes, self._engine.local_ranges()).all():
            raise ValueError("an op writes outside this engine's registered memory")
        views = wire.views_for(np.stack([local, nbytes], axis=1), self._engine.local_views())
        payload = np.stack([remote, nbytes], axis=1).astype(">u8").tobytes()
        return self._send(wire.PULL, payload, views, int(nbytes.sum()))

    def request(self, payload: bytes) -> TcpPending:
        """Send a request; the pending's result is the peer's reply."""
        if len(payload) > wire.MAX_REQUEST_BYTES:
            raise ValueError(f"request of {len(payload)} bytes (max {wire.MAX_REQUEST_BYTES})")
        return self._send(wire.REQ, payload, None, 0)

    def abort(self) -> None:
        """Give the peer up: pendings fail, and once this returns no byte lands any more."""
        self._fail("aborted")
        if threading.current_thread() is not self._reader:
            self._reader.join()

    def _send(self, kind: int, payload: bytes, views: list[memoryview] | None,
              expect: int) -> TcpPending:
        pending = TcpPending()
        with self._lock:
            if self._failed:
                pending._finish(error="link failed")
                return pending
            self._next_id = (self._next_id + 1) & 0xFFFFFFFFFFFFFFFF
            ident = self._next_id
            self._pending[ident] = (pending, views, expect)
        try:
            with self._send_lock:
                self._sock.sendall(wire.pack_header(kind, len(payload), ident) + payload)
        except OSError as exc:
            self._fail(f"send failed: {exc}")
        return pending

    def _read_loop(self) -> None:
        try:
            while True:
                kind, length, ident = wire.read_frame(self._sock, 1 << 40)
                with self._lock:
                    entry = self._pending.pop(ident, None)
                if entry is None:
                    raise wire.WireError(f"frame of kind {kind} for unknown id {ident}")
                pending, views, expect = entry
                if kind == wire.DATA and views is not None and length == expect:
                    wire.recv_views(self._sock, views)
                    pending._finish()
                elif kind == wire.REP and views is None and length <= wire.MAX_REQUEST_BYTES:
                    pending._finish(wire.recv_exact(self._sock, length))
                elif kind == wire.FAIL and length <= wire.MAX_REQUEST_BYTES:
                    why = wire.recv_exact(self._sock, length).decode(errors="replace")
                    pending._finish(error=f"refused by the peer: {why}")
                else:
                    raise wire.WireError(f"unexpected frame kind {kind} ({length} bytes)")
        except (OSError, wire.WireError) as exc:
            self._fail(str(exc) or type(exc).__name__)

    def _fail(self, why: str) -> None:
        with self._lock:
            if not self._failed:
                self._failed = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            pendings, self._pending = list(self._pending.values()), {}
        for pending, _, _ in pendings:
            pending._finish(error=f"peer {self._label}: {why}")

    def close(self) -> None:
        """Abort and close the socket."""
        self.abort()
        self._sock.close()


class _ServerConn:
    """One accepted connection: the hello, then its frames, served in order."""

    def __init__(self, engine: TcpEngine, sock: socket.socket, peer: str) -> None:
        self.engine = engine
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"pdserve-kv-tcp-serve-{peer}")

    def send_frame(self, kind: int, ident: int, payload: bytes) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(wire.pack_header(kind, len(payload), ident) + payload)
        except OSError as exc:
            logger.debug("reply to %s dropped: %s", self.peer, exc)

    def _run(self) -> None:
        try:
            if not self._hello():
                return
            while True:
                kind, length, ident = wire.read_frame(
                    self.sock, max(wire.MAX_REQUEST_BYTES, 16 * wire.MAX_PULL_OPS))
                payload = wire.recv_exact(self.sock, length)
                if kind == wire.REQ and length <= wire.MAX_REQUEST_BYTES:
                    self.engine._enqueue(_Incoming(payload, self, ident))
                elif kind == wire.PULL and length % 16 == 0:
                    self._serve_pull(ident, payload)
                else:
                    raise wire.WireError(f"unexpected frame kind {kind} ({length} bytes)")
        except (OSError, wire.WireError) as exc:
            logger.debug("connection from %s ended: %s", self.peer, exc)
        finally:
            self.engine._forget(self)
            self.sock.close()

    def _hello(self) -> bool:
        server_nonce = os.urandom(wire.NONCE_LEN)
        instance = self.engine.instance
        self.sock.settimeout(HELLO_TIMEOUT_S)
        self.sock.sendall(wire.MAGIC + instance + server_nonce)
        answer = wire.recv_exact(self.sock, wire.NONCE_LEN + wire.MAC_LEN)
        client_nonce, mac = answer[:wire.NONCE_LEN], answer[wire.NONCE_LEN:]
        keys = self.engine.keys()
        if keys:
            key = wire.accepted_key(keys, instance, server_nonce, client_nonce, mac)
            if key is None:
                self.engine.refused_hellos += 1
                logger.warning("KV connection from %s refused: it did not prove the cluster "
                               "secret", self.peer)
                return False
        else:
            key = None
        self.sock.sendall(wire.server_mac(key, instance, server_nonce, client_nonce))
        self.sock.settimeout(None)
        return True

    def _serve_pull(self, ident: int, payload: bytes) -> None:
        ops = np.frombuffer(payload, dtype=">u8").astype(np.uint64).reshape(-1, 2)
        if not wire.inside(ops[:, 0], ops[:, 1], self.engine.local_ranges()).all():
            self.engine.refused_pulls += 1
            logger.warning("pull from %s refused: a range lies outside the registered KV "
                           "memory", self.peer)
            self.send_frame(wire.FAIL, ident, b"range outside the registered memory")
            return
        views = wire.views_for(ops, self.engine.local_views())
        total = int(ops[:, 1].sum()) if len(ops) else 0
        with self._send_lock:
            wire.send_views(self.sock, wire.pack_header(wire.DATA, total, ident), views)


class TcpEngine:
    """One engine's sealed TCP endpoint: registered memory, a listener, links, an inbox."""

    def __init__(self, name: str = "pdserve", *, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, keys: KeySource | None = None) -> None:
        self.name = name
        self.instance = os.urandom(wire.INSTANCE_LEN)
        self.keys: KeySource = keys or (lambda: ())
        self.refused_hellos = 0
        """Connections closed because they did not prove the cluster secret."""
        self.refused_pulls = 0
        """Pulls refused because a range left the registered memory."""
        self.dropped_requests = 0
        self._lock = threading.Lock()
        self._regions: list[TcpRegion] = []
        self._views: list[tuple[int, memoryview]] = []
        self._inbox: collections.deque[_Incoming] = collections.deque()
        self._inbox_cond = threading.Condition(self._lock)
        self._conns: set[_ServerConn] = set()
        self._links: list[TcpLink] = []
        self._closed = False
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(128)
        port = self._listener.getsockname()[1]
        hosts = [advertise_host] if advertise_host else _advertised_hosts(bind_host)
        self._address = json.dumps({"v": 1, "hosts": hosts, "port": port,
                                    "instance": self.instance.hex()}).encode()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"pdserve-kv-tcp-accept-{name}")
        self._acceptor.start()

    @property
    def address(self) -> bytes:
        """Blob peers pass to ``connect`` (hosts, port, this engine's instance)."""
        return self._address

    @property
    def locality(self) -> bytes:
        """b"": no same-host path."""
        return b""

    def register(self, addr: int, length: int, *, keepalive: object = None) -> TcpRegion:
        """Serve pulls of ``[addr, addr + length)`` (host memory) until ``close``."""
        if getattr(keepalive, "is_cuda", False):
            raise TransportError("the tcp transport serves host memory only")
        region = TcpRegion(int(addr), int(length), keepalive)
        with self._lock:
            self._regions.append(region)
            self._views.append((region.addr, wire.memory_view(region.addr, region.length)))
        return region

    def local_ranges(self) -> list[tuple[int, int]]:
        """(base, length) of every registered region."""
        return [(r.addr, r.length) for r in self._regions]

    def local_views(self) -> list[tuple[int, memoryview]]:
        """(base, byte view) of every registered region."""
        return list(self._views)

    def connect(self, peer_address: bytes, locality: bytes | None = None) -> TcpLink:
        """Open an authenticated link to the engine whose ``address`` is given; raises
        PeerUnreachable when no host answers or the hello fails."""
        try:
            info = json.loads(peer_address)
            hosts, port, instance = info["hosts"], int(info["port"]), bytes.fromhex(
                info["instance"])
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerUnreachable(f"not a tcp transport address: {exc}") from exc
        errors = []
        for host in hosts:
            try:
                sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            try:
                self._client_hello(sock, instance)
            except (OSError, wire.WireError) as exc:
                sock.close()
                errors.append(f"{host}:{port}: {exc}")
                continue
            link = TcpLink(self, sock, f"{host}:{port}")
            with self._lock:
                self._links.append(link)
            return link
        raise PeerUnreachable("cannot reach the KV peer: " + "; ".join(errors))

    def _client_hello(self, sock: socket.socket, instance: bytes) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = wire.recv_exact(sock, wire.HELLO_LEN)
        if hello[:len(wire.MAGIC)] != wire.MAGIC:
            raise wire.WireError("not a pdserve KV endpoint")
        got_instance = hello[len(wire.MAGIC):len(wire.MAGIC) + wire.INSTANCE_LEN]
        if got_instance != instance:
            raise wire.WireError("another engine answers on that port")
        server_nonce = hello[len(wire.MAGIC) + wire.INSTANCE_LEN:]
        client_nonce = os.urandom(wire.NONCE_LEN)
        keys = self.keys()
        key = keys[0] if keys else None
        sock.sendall(client_nonce + wire.client_mac(key, instance, server_nonce, client_nonce))
        proof = wire.recv_exact(sock, wire.MAC_LEN)
        if key is not None and not hmac.compare_digest(
                proof, wire.server_mac(key, instance, server_nonce, client_nonce)):
            raise wire.WireError("the peer did not prove the cluster secret")
        sock.settimeout(None)

    def poll_requests(self) -> list[_Incoming]:
        """Requests received so far (non-blocking)."""
        with self._lock:
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def wait_requests(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a request; True if one is queued."""
        with self._inbox_cond:
            if not self._inbox and not self._closed:
                self._inbox_cond.wait(timeout_s)
            return bool(self._inbox)

    def close(self) -> None:
        """Stop serving and fail every link's pendings; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, links = list(self._conns), list(self._links)
            self._inbox_cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for link in links:
            link.close()

    def _enqueue(self, incoming: _Incoming) -> None:
        with self._inbox_cond:
            if len(self._inbox) >= IN_QUEUE_MAX:
                self.dropped_requests += 1
                return
            self._inbox.append(incoming)
            self._inbox_cond.notify()

    def _forget(self, conn: _ServerConn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    sock.close()
                    continue
                conn = _ServerConn(self, sock, f"{peer[0]}:{peer[1]}")
                self._conns.add(conn)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.thread.start()


def _advertised_hosts(bind_host: str) -> list[str]:
    """Where peers can reach a listener bound to ``bind_host``: itself, or for a wildcard the
    host name's addresses, then loopback."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return [bind_host]
    hosts: list[str] = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addr = str(info[4][0])
            if addr not in hosts and not addr.startswith("127."):
                hosts.append(addr)
    except OSError:
        pass
    return hosts + ["127.0.0.1"]
