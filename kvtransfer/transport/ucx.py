"""One-sided transport: registered regions, GET pulls (UCX RMA, or process_vm_readv on the same
host) and small request/reply messages (UCX active messages).

The native side (`kernels.native._ucxrma`, plain C over libucp) owns one UCP context and one
worker in UCS_THREAD_MODE_MULTI, progressed by a pthread that sleeps on the worker's event fd when
idle. Python never runs on that thread: UCX callbacks copy into C queues guarded by a mutex, and
this module only polls or waits on them (with the GIL released).

Contract for callers (the KV connector):
  - `UcxEngine.register` whole KV tensors once; ship `Region.rkey` and addresses to peers.
  - `UcxEngine.connect(peer_address, locality)` once per remote worker (caching is the caller's
    job; `locality` is the peer's `UcxEngine.locality`, shipped next to its address), then
    `Peer.unpack_rkey(rkey, base=, length=)` once per remote region (base and length are
    required); the returned index goes in column 3 of `get` ops, and every op is checked
    against that region.
  - `Peer.get(ops)` posts every GET natively and one ep flush; the `Transfer` completes when all
    bytes have landed, or errors when the peer dies or is aborted. Every wait takes a deadline.
    Every op's local range must lie inside one region registered with this engine (ValueError
    otherwise), on both read paths.
  - `Peer.abort()` force-closes the endpoint; after it returns no byte of that peer's GETs can
    still land in local memory.
  - `IncomingRequest.reply` answers over an endpoint this engine creates to the requester's
    worker address (`IncomingRequest.sender`) and keeps for later replies (up to 1,024
    requesters; UCX's connection matching may pair it with the requester's own endpoint to us,
    else it connects anew). That endpoint is created only for a reply the caller vouches for
    (`vouched=True`: the connector's responder passes False unless the requester proved a
    lease); a reply not vouched for goes out only over an endpoint we already hold to that
    address, else it is dropped and counted in `unanswered_strangers`, so a request cannot
    make the engine connect to an address it merely names (security review finding 15).
    UCX's reply endpoint is never kept past the message's callback: UCX destroys it when the
    requester fails, so a handle kept for a later reply could name freed memory (security
    review finding 17). If the requester is gone the send fails and the reply is dropped
    (counted in `failed_replies`).

Same-host path ("pvm"). When the peer's locality shows the same kernel boot and pid namespace,
`connect` probes it with one process_vm_readv(2) of a random nonce inside the peer's engine. If
the probe reads the right bytes, that peer's `get`s bypass UCX: native worker threads (not the
progress thread; `pvm_threads`, default 2 when 2+ CPUs are usable) read the ops as
iovec batches of up to IOV_MAX segments and 4 MiB (`pvm_chunk_kib`), so one big get
is split across the workers, looping over short reads, and re-read the nonce at the end, so a
get succeeds only if every byte came from the same live peer engine
(not from a process that reused a dead peer's pid, nor after the peer closed its engine: close
wipes the nonce). ESRCH marks the peer failed and the Transfer errors. If the probe fails (EPERM:
different uid, Yama ptrace_scope >= 2, a non-dumpable peer; ENOSYS; ESRCH) the peer stays on UCX
and a warning is logged once per reason; `Peer.path` / `Peer.path_reason` / `Transfer.path` tell
which path is used. Requests and replies always go over UCX.

Security note: every engine (unless `same_host=False`) calls
prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) at creation, because under Yama ptrace_scope=1 only
ancestors may otherwise process_vm_readv a process. This lets any process of the same uid (and
only those: the kernel's uid, capability and dumpable checks still apply) ptrace or read this
process, as they could without Yama.
`same_host=False` turns the path off: no prctl, an empty `locality`, and `connect` ignores
any locality given (every get uses UCX). The path reads host memory only: an engine that
registered device (CUDA) memory advertises no locality and reads every peer over UCX.

Knobs are `UcxEngine` arguments (the connector passes `ConnectorConfig.ucx_options()`); UCX's
own configuration applies too: every `UCX_*` environment variable (e.g. `UCX_TLS`); the one
default pdserve changes is `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` where cuda_ipc exists (see
`CUDA_IPC_GET_ENV`). Which UCX runs is chosen when the extension is built
(`python -m kernels.native.build --ucx ...`); `kernels.native.runtime_info()` reports it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvtransfer.errors import PeerUnreachable, TransferTimeout, TransportError

if TYPE_CHECKING:
    from numpy.typing import NDArray

logger = logging.getLogger(__name__)

TransferState = Literal["pending", "done", "error"]
PathName = Literal["pvm", "ucx"]
_STATES: tuple[TransferState, TransferState, TransferState] = ("pending", "done", "error")

_logged_fallbacks: set[str] = set()
# Reasons for the UCX path that are configuration, not a failed same-host probe (not warned).
_EXPECTED_UCX_REASONS = ("different host", "different pid namespace",
                         "same-host path off (same_host=False)",
                         "local KV memory is not host memory")


def _load_native() -> Any:
    """The C extension (built by `make setup`; never compiled here)."""
    from kernels import native

    try:
        return native.load()
    except native.NativeUnavailable as exc:
        raise TransportError(f"native UCX module unavailable: {exc}") from exc


def _memory_type(keepalive: object) -> str | None:
    """"cuda" for a CUDA tensor, None (let UCX detect) otherwise."""
    return "cuda" if getattr(keepalive, "is_cuda", False) else None


def _wrap(exc: Exception) -> TransportError:
    return TransportError(str(exc))


class Region:
    """Memory registered with `UcxEngine.register`; stays registered until the engine closes."""

    __slots__ = ("addr", "length", "rkey", "index", "memory_type", "_keepalive")

    def __init__(self, addr: int, length: int, rkey: bytes, index: int, keepalive: object,
                 memory_type: str = "host") -> None:
        self.addr = addr
        self.memory_type = memory_type
        """What UCX found the memory to be ("host", "cuda", ...)."""
        self.length = length
        self.rkey = rkey
        """Packed remote key (ucp_rkey_pack): ship it to peers that will read this region."""
        self.index = index
        self._keepalive = keepalive

    def __repr__(self) -> str:
        return f"Region(addr={self.addr:#x}, length={self.length}, rkey=<{len(self.rkey)} B>)"


class Transfer:
    """Completion handle of a `Peer.get` or `Peer.request`."""

    __slots__ = ("_x", "_peer", "_kind")

    def __init__(self, x: Any, peer: Peer, kind: str) -> None:
        self._x = x
        self._peer = peer
        self._kind = kind

    def poll(self) -> TransferState:
        """Non-blocking: "pending", "done" or "error"."""
        return _STATES[self._x.state()]

    def wait(self, timeout_s: float) -> None:
        """Block (GIL released) until done.

        Raises TransferTimeout after aborting the peer when the deadline passes (so no late write
        lands), PeerUnreachable when the peer died, TransportError on any other failure.
        """
        state = _STATES[self._x.wait(float(timeout_s))]
        if state == "done":
            return
        if state == "pending":
            logger.warning("%s to peer timed out after %.3f s; aborting the peer",
                           self._kind, timeout_s)
            self._peer.abort()
            raise TransferTimeout(f"{self._kind} did not complete within {timeout_s} s")
        self._raise()

    def result(self) -> bytes:
        """The peer's reply for `request()`, b"" for `get()`; raises if not done."""
        state = self.poll()
        if state == "error":
            self._raise()
        if state == "pending":
            raise TransportError(f"{self._kind} is still pending")
        return bytes(self._x.result())

    @property
    def error(self) -> str | None:
        """UCX's error text once the transfer failed, else None."""
        err: str | None = self._x.error
        return err

    @property
    def path(self) -> PathName | None:
        """For a get: "pvm" (same-host process_vm_readv) or "ucx"; None for a request."""
        path: PathName | None = self._x.path
        return path

    def _raise(self) -> None:
        msg = f"{self._kind} failed: {self._x.error}"
        if self._peer.failed:
            raise PeerUnreachable(msg)
        raise TransportError(msg)


class Peer:
    """An endpoint to one remote worker (created by `UcxEngine.connect`)."""

    __slots__ = ("_c", "_engine", "__weakref__")

    def __init__(self, c: Any, engine: UcxEngine) -> None:
        self._c = c
        self._engine = engine  # keeps the engine (and the C worker) alive as long as we are

    def unpack_rkey(self, packed: bytes, *, base: int | None = None,
                    length: int | None = None) -> int:
        """Unpack a peer's `Region.rkey` for this endpoint; returns the index used in `get` ops.

        `base` and `length` (the region's `Region.addr` / `Region.length` on the peer) are
        required here (ValueError without them: the `Link` protocol leaves them optional for
        transports whose server checks every read); `get` rejects (ValueError) any op reading
        outside that region, on either path.
        """
        if base is None or length is None:
            raise ValueError("the UCX transport needs the remote region's base and length")
        try:
            return int(self._c.unpack_rkey(bytes(packed), int(base), int(length)))
        except _load_native().NativeTransportError as exc:
            raise self._error(exc) from exc

    def get(self, ops: NDArray[np.int64] | NDArray[np.uint64]) -> Transfer:
        """Pull remote bytes: `ops` is (n, 4) int64/uint64 rows (local, remote, nbytes, rkey_index).

        Same-host peers (`path == "pvm"`): the rows are queued to the native pvm workers and
        read with process_vm_readv. Otherwise every row is posted to UCX natively (no per-op
        Python), followed by one endpoint flush. Either way the call returns at once and the
        Transfer completes when all rows have landed (or errors; never a partial success).
        Raises IndexError for an unknown rkey index, ValueError for a null address, a range
        outside the region given to `unpack_rkey` or a local range outside every region
        registered with this engine, PeerUnreachable once the peer failed.
        """
        arr = np.asarray(ops)
        if arr.ndim != 2 or arr.shape[1] != 4:
            raise ValueError(f"ops must have shape (n, 4), got {arr.shape}")
        if arr.dtype not in (np.int64, np.uint64):
            raise ValueError(f"ops must be int64 or uint64, got {arr.dtype}")
        arr = np.ascontiguousarray(arr)
        try:  # the native side refuses a failed peer, under the lock its error callback takes
            return Transfer(self._c.get(arr), self, "get")
        except _load_native().NativeTransportError as exc:
            raise self._error(exc) from exc

    def request(self, payload: bytes) -> Transfer:
        """Send a request message; `Transfer.result()` is the peer's reply."""
        try:
            return Transfer(self._c.request(payload), self, "request")
        except _load_native().NativeTransportError as exc:
            raise self._error(exc) from exc

    def _error(self, exc: Exception) -> TransportError:
        """PeerUnreachable once the peer failed, else a TransportError with the native text."""
        if self.failed:
            return PeerUnreachable(f"peer failed: {self._c.fail_reason}")
        return _wrap(exc)

    def abort(self) -> None:
        """Force-close the endpoint; every outstanding op of this peer completes with an error.

        Idempotent. When it returns, no GET of this peer can still write into local memory.
        """
        try:
            self._c.abort(5.0)
        except _load_native().NativeTransportError as exc:
            raise _wrap(exc) from exc

    @property
    def failed(self) -> bool:
        """True once UCX reported the peer dead (ep error callback)."""
        return bool(self._c.failed)

    @property
    def closed(self) -> bool:
        """True once aborted or the engine closed."""
        return bool(self._c.closed)

    @property
    def path(self) -> PathName:
        """How `get` reads: "pvm" (same host, process_vm_readv) or "ucx" (UCX RMA GET)."""
        path: PathName = self._c.path
        return path

    @property
    def path_reason(self) -> str | None:
        """Why this peer uses UCX ("different host", "process_vm_readv probe ...: ..."), or None."""
        reason: str | None = self._c.path_reason
        return reason

    @property
    def data_error_handling(self) -> str:
        """UCX error handling on the endpoint that carries gets: "peer", or "none" toward a peer
        in this kernel boot and pid namespace while cma is allowed (cma needs it off)."""
        mode: str = self._c.data_error_handling
        return mode


class IncomingRequest:
    """A request received from a peer; answer it once with `reply`."""

    __slots__ = ("payload", "sender", "_engine", "_req_id", "_replied")

    def __init__(self, payload: bytes, engine: UcxEngine, sender: bytes, req_id: int) -> None:
        self.payload = payload
        self.sender = sender
        """The requester's worker address: the reply goes to it."""
        self._engine = engine
        self._req_id = req_id
        self._replied = False

    def reply(self, payload: bytes, *, vouched: bool = True) -> None:
        """Send the reply (once), from any thread, however long after the request came; a no-op
        that logs when the requester is gone. Not ``vouched``: sent only over an endpoint the
        engine already holds to the sender (never a new connection), else dropped."""
        if self._replied:
            raise TransportError("request already answered")
        self._replied = True
        self._engine._reply(self.sender, self._req_id, payload, vouched)


CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
"""UCX's switch for GETs over CUDA IPC. Its default ("auto") turns them off on a machine where
NVML reports no NVLink, and a pull of device memory then falls back to message emulation over
tcp (measured on one H200: 0.5-0.6 GB/s, a 16-block pull in 8.7 ms, where cuda_ipc moves 1 GiB
at 1.3-1.9 TB/s). A pull is all GETs, so the engine opens its worker with it set to "y" when
the context has cuda_ipc and the environment does not set it (`kernels/native/ucx_core.c`,
`ucx_engine_open`; unset again after, so child processes do not inherit it)."""


def _close_quietly(c: Any) -> None:
    try:
        c.close()
    except Exception:  # at interpreter exit there is nobody left to report to
        logger.debug("engine close at exit failed", exc_info=True)


class UcxEngine:
    """One UCP context + one worker (UCS_THREAD_MODE_MULTI) + a native progress thread."""

    def __init__(self, *, name: str = "pdserve", same_host: bool = True, pvm_threads: int = 0,
                 pvm_chunk_kib: int = 4096, thp: str = "collapse", wakeup: bool = True,
                 spin_us: float = 200.0) -> None:
        """Create the context, worker and progress thread.

        same_host: advertise a locality and read same-host peers with process_vm_readv.
        pvm_threads: same-host reader threads (0: 2 when 2+ CPUs are usable, else 1).
        pvm_chunk_kib: bytes per same-host read batch, in KiB.
        thp: "collapse" | "advise" | "off": huge pages for registered host memory.
        wakeup: the progress thread sleeps on the worker's event fd when idle (False: it backs
            off with short sleeps, which lets event-less transports such as cma carry RMA).
        spin_us: the progress thread keeps polling this long after the last event.
        """
        native = _load_native()
        try:
            self._c = native.Engine(name, same_host=same_host, pvm_threads=pvm_threads,
                                    pvm_chunk_kib=pvm_chunk_kib, thp=thp, wakeup=wakeup,
                                    spin_us=spin_us)
        except native.NativeTransportError as exc:
            raise TransportError(f"UCX init failed: {exc}") from exc
        self._name = name
        self._lock = threading.Lock()
        self._regions: list[Region] = []
        self._closed = False
        # Close on GC or at exit, whichever comes first; the finalizer holds only the C object.
        self._finalizer = weakref.finalize(self, _close_quietly, self._c)
        self._finalizer.atexit = True

    @property
    def address(self) -> bytes:
        """This worker's address blob (ucp_worker_query): peers pass it to `connect`."""
        return bytes(self._c.address)

    @property
    def locality(self) -> bytes:
        """Opaque same-host identity (boot id, pid namespace, pid, a nonce and its address):
        peers pass it to `connect` next to `address`. b"" when the same-host path is off
        (`same_host=False`, device memory registered) or /proc is unreadable; passing b"" is
        like passing None."""
        return bytes(self._c.locality)

    def register(self, addr: int, length: int, *, keepalive: object = None,
                 memory_type: str | None = None) -> Region:
        """Register existing memory (ucp_mem_map, no allocation) until the engine closes.

        `keepalive` (e.g. the tensor or array owning the memory) is referenced by the Region.
        `memory_type` "cuda" asks UCX to map device memory (a CUDA tensor as `keepalive` implies
        it; run on one H200 by `bench/gpu_check.sh`); None lets UCX detect the type.
        Registering device memory turns this engine's same-host path off (it reads host memory
        only).
        Host memory is also advised into transparent huge pages (the 2 MiB-aligned interior:
        MADV_HUGEPAGE then MADV_COLLAPSE, errors ignored; about 0.5 s per GiB, once), because
        same-host readers pin it page by page and 4 KiB pages cost ~3x in throughput.
        `thp="advise"` skips the synchronous collapse, `thp="off"` does neither.
        """
        mtype = memory_type or _memory_type(keepalive)
        try:
            index, rkey, found = self._c.register(int(addr), int(length), mtype)
        except self._native_error() as exc:
            raise _wrap(exc) from exc
        region = Region(int(addr), int(length), bytes(rkey), int(index), keepalive, str(found))
        with self._lock:
            self._regions.append(region)
        return region

    def connect(self, peer_address: bytes, locality: bytes | None = None) -> Peer:
        """Create an endpoint (peer error handling on) to the worker at `peer_address`.

        `locality` is the peer's `UcxEngine.locality`: when it shows a peer on this host that we
        may read, its gets use process_vm_readv (`Peer.path == "pvm"`), else UCX.
        """
        try:
            c = self._c.connect(bytes(peer_address),
                                None if locality is None else bytes(locality))
        except self._native_error() as exc:
            raise PeerUnreachable(f"cannot connect: {exc}") from exc
        peer = Peer(c, self)
        reason = peer.path_reason
        if locality and reason is not None and reason not in _EXPECTED_UCX_REASONS:
            key = reason.split(" of pid ")[0] + reason.rsplit(":", 1)[-1]
            if key not in _logged_fallbacks:
                _logged_fallbacks.add(key)
                logger.warning("same-host reads unavailable, using UCX: %s", reason)
            else:
                logger.debug("same-host reads unavailable, using UCX: %s", reason)
        return peer

    def poll_requests(self) -> list[IncomingRequest]:
        """Drain the request messages received so far (non-blocking)."""
        return [IncomingRequest(payload, self, sender, req_id)
                for req_id, sender, payload in self._c.poll_requests()]

    def wait_requests(self, timeout_s: float) -> bool:
        """Block (GIL released) until a request is queued or `timeout_s` passes; True if one is."""
        return bool(self._c.wait_requests(float(timeout_s)))

    @property
    def dropped_messages(self) -> int:
        """Malformed messages and replies that arrived after their request was given up."""
        return int(self._c.dropped_messages)

    @property
    def failed_replies(self) -> int:
        """Replies that could not be sent or delivered (the requester was gone)."""
        return int(self._c.failed_replies)

    @property
    def unanswered_strangers(self) -> int:
        """Replies not vouched for and dropped: we held no endpoint to their requester."""
        return int(self._c.unanswered_strangers)

    @property
    def reply_peers(self) -> tuple[int, int]:
        """(endpoints kept to requesters for replies, how many of them UCX reported failed)."""
        total, failed = self._c.reply_peers
        return int(total), int(failed)

    def close(self) -> None:
        """Stop the progress thread, close endpoints, unmap memory, destroy the worker; idempotent.

        Pending transfers turn to "error"; Transfer/Peer objects stay safe to use (they raise).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()

    def __enter__(self) -> UcxEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def context_info(self) -> str:
        """UCX's description of this context: components, domains, usable resources."""
        return str(self._c.context_info())

    @property
    def memory_types(self) -> list[str]:
        """Memory types this UCX context can register ("host", and "cuda" with a GPU stack)."""
        return list(self._c.memory_types)

    def _native_error(self) -> type[Exception]:
        err: type[Exception] = _load_native().NativeTransportError
        return err

    def _reply(self, sender: bytes, req_id: int, payload: bytes, vouched: bool) -> None:
        if self._closed:
            logger.warning("reply dropped: engine %s is closed", self._name)
            return
        try:
            if not self._c.reply(sender, req_id, payload, vouched):
                logger.debug("reply dropped: requester not vouched for and not connected")
        except self._native_error() as exc:
            logger.warning("reply dropped: requester gone: %s", exc)
