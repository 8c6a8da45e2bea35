"""NIXL transport: READ transfers for the KV bytes, NIXL notifications for the lease messages.

Implements ``kvtransfer.transport.base.Transport`` with one NIXL agent (UCX backend) per engine,
so a deployment can use NIXL's wire (its bundled UCX with verbs/EFA, or its other plugins)
under pdserve's lease protocol.

Control channel. Lease releases travel as NIXL notifications on the same agents, not on a
second transport: one UCX stack per process (NIXL's bundled UCX and the libucx wheel's would
otherwise both run in every worker), one wire to configure, and no dependency on our native
extension where NIXL is chosen (e.g. GPU nodes). A request is ``Q | id | requester address |
payload``; the requester's address is its NIXL agent metadata (~0.5 KiB), so the answering
engine can load it and reply ``R | id | payload`` with ``send_notif``. The prefill keeps
the decision: it answers "ok" or "expired" from its lease table exactly as over UCX. Request
ids are 64 random bits (a peer cannot answer a pending request by guessing its id).

Who is answered (security review finding 15). Loading an agent's metadata opens UCX
endpoints to wherever that metadata points, so a request must not make the engine load what
it merely carries. A request is kept only when its address names the agent NIXL says sent it
(``get_new_notifs`` is keyed by the sender's name; others are dropped and counted in
``foreign_messages``), and a reply is taken only from the agent its request went to. The
answer goes out only to an agent already loaded, or when the responder vouches for the
request (``NixlIncoming.reply(vouched=True)``: the connector's responder vouches only for a
request that echoed the token of a lease it granted); otherwise it is dropped and counted in
``unanswered_strangers``. The sender's name is what the sending NIXL agent wrote into its
message, not authenticated: the lease token is what vouches, the binding only stops an honest
agent's requests being answered to a third one. At most ``MAX_LOADED_AGENTS`` remote agents
stay loaded; past that the least recently used without a READ in flight is unloaded
(``remove_remote_agent``, counted in ``evicted_agents``) and loaded again on its next use: a
link keeps its peer's address, a requester sends its own with every request.

Progress. NIXL's own progress thread is off. Its Python API hard-codes the thread's poll
delay to 0 (``nixl_agent.__init__`` sets ``pthrDelay = 0``), and in NIXL 1.4-1.5 the UCX
plugin's thread then calls ``poll(fds, 0)`` in a loop: an idle agent keeps a whole core busy
(measured here: 99.7 % of a core with the thread, ~0 % without). That is what made vLLM's
NixlConnector crawl on a 2-core machine. Instead NIXL is progressed by our own calls:
``Pending.poll`` on the reading side (``check_xfer_state`` progresses the worker), and
``wait_requests`` on the serving side, which polls notifications every ``HOT_POLL_S`` while
``reads_expected()`` says a lease is active (a peer may be reading: over tcp UCX emulates
the read with messages the target must progress) and every ``COLD_POLL_S`` otherwise. An
engine with no pull, no lease and no release in flight makes no NIXL call per decode step.

Memory. Host memory registers as ``DRAM``; a CUDA tensor passed as ``keepalive`` registers as
``VRAM`` on its device (untested: the GPU check carries no NIXL wheel, so only our UCX engine
has pulled GPU memory). The memory type travels in the region's ``rkey`` field of our
handshake. NIXL's READs are UCX GETs too: on one host they need
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` (``kvtransfer.transport.ucx.CUDA_IPC_GET_ENV``), which the
GPU deployments set in the workers' environment (NIXL opens its own UCX, so the engine's
default does not reach it).

Aborts. ``Link.abort`` releases the link's posted READs (NIXL cancels what UCX can cancel)
and removes the remote agent (its endpoints close). That is NIXL's strongest guarantee and is
weaker than ``UcxEngine``'s, which waits for the forced endpoint close to complete.

Parameters: ``HOT_POLL_S`` = 0.001, ``COLD_POLL_S`` = 0.05 (seconds between notification
polls of ``wait_requests``); ``MAX_LOADED_AGENTS`` = 1,024 (remote agents kept loaded, least
recently used unloaded first; ``NixlEngine(max_loaded_agents=)``); ``MAX_QUEUED_REQUESTS`` =
16,384 (requests received and not yet taken by ``poll_requests``; more are dropped, counted in
``dropped_messages``, as the UCX engine's queue).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels.native.ucx_modules import efa_module_skipped, nixl_module_dir
from kvtransfer.errors import PeerUnreachable, TransportError
from kvtransfer.transport.base import TransferState

if TYPE_CHECKING:
    from numpy.typing import NDArray

logger = logging.getLogger(__name__)

HOT_POLL_S = 0.001
COLD_POLL_S = 0.05
MAX_LOADED_AGENTS = 1024
MAX_QUEUED_REQUESTS = 16384
_ADDRESS_MAGIC = b"pdnixl1"
_REQUEST, _REPLY = b"Q", b"R"
_REQ_HEAD = struct.Struct("!QI")  # request id, length of the requester's address
_REP_HEAD = struct.Struct("!Q")  # request id


def _nixl_api() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise TransportError(f"NIXL is not installed ({exc}); `make setup` installs it "
                             "(pip install --no-deps nixl nixl-cu12)") from exc
    return _api


def encode_address(agent_name: str, metadata: bytes) -> bytes:
    """Our address blob: NIXL agent name + full agent metadata."""
    name = agent_name.encode()
    return _ADDRESS_MAGIC + struct.pack("!H", len(name)) + name + metadata


def decode_address(address: bytes) -> tuple[str, bytes]:
    """Inverse of ``encode_address``; raises TransportError when it is not one."""
    head = len(_ADDRESS_MAGIC)
    if not address.startswith(_ADDRESS_MAGIC) or len(address) < head + 2:
        raise TransportError("not a NIXL engine address (is the peer on another transport?)")
    (n,) = struct.unpack_from("!H", address, head)
    try:
        name = address[head + 2:head + 2 + n].decode()
    except UnicodeDecodeError as exc:
        raise TransportError("NIXL engine address with a malformed agent name") from exc
    return name, address[head + 2 + n:]


def _mem_kind(keepalive: object) -> tuple[str, int]:
    """("VRAM", device) for a CUDA tensor, else ("DRAM", 0)."""
    device = getattr(keepalive, "device", None)
    if getattr(device, "type", None) == "cuda":
        return "VRAM", int(device.index or 0)  # type: ignore[union-attr]
    return "DRAM", 0


class NixlRegion:
    """Memory registered with a ``NixlEngine``."""

    __slots__ = ("addr", "length", "mem_type", "device", "rkey", "_descs", "_keepalive")

    def __init__(self, addr: int, length: int, mem_type: str, device: int, descs: Any,
                 keepalive: object) -> None:
        self.addr = addr
        self.length = length
        self.mem_type = mem_type
        self.device = device
        self.rkey = f"{mem_type}:{device}".encode()
        """Memory type and device: peers need it to describe this region to NIXL."""
        self._descs = descs
        self._keepalive = keepalive

    def contains(self, addr: int, nbytes: int) -> bool:
        """True when [addr, addr + nbytes) lies inside the region."""
        return self.addr <= addr and addr + nbytes <= self.addr + self.length


class _Done:
    """A pending operation that completed at once (an empty read)."""

    error: str | None = None

    def poll(self) -> TransferState:
        return "done"

    def result(self) -> bytes:
        return b""


class NixlGet:
    """A posted NIXL READ; ``poll`` drives the agent's progress."""

    def __init__(self, link: NixlLink, handle: Any, state: str) -> None:
        self._link = link
        self._handle: Any = handle
        self._state: TransferState = "pending"
        self.error: str | None = None
        self._settle(state)

    def _settle(self, nixl_state: str) -> None:
        if nixl_state == "DONE":
            self._state = "done"
        elif nixl_state == "ERR":
            self._state = "error"
            self.error = "NIXL reported an error for the READ"
            self._link._mark_failed(self.error)
        if self._state != "pending":
            self._release()

    def _release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            self._link._engine._agent_call("release_xfer_handle", handle)
        except Exception as exc:  # NIXL refused to cancel: log, the link is given up anyway
            logger.warning("releasing a NIXL READ failed: %s", exc)
        self._link._engine._read_settled(self._link.name)

    def poll(self) -> TransferState:
        """Non-blocking: "pending", "done" or "error"."""
        if self._state == "pending" and self._handle is not None:
            try:
                self._settle(self._link._engine._agent_call("check_xfer_state", self._handle))
            except TransportError as exc:
                self._state, self.error = "error", str(exc)
                self._release()
        return self._state

    def result(self) -> bytes:
        """b"" once done; raises otherwise."""
        if self.poll() != "done":
            raise TransportError(f"get is {self._state}: {self.error}")
        return b""

    def cancel(self, reason: str) -> None:
        """End a pending READ in error (used by ``NixlLink.abort``)."""
        if self._state == "pending":
            self._state, self.error = "error", reason
        self._release()


class NixlReply:
    """The answer to a ``NixlLink.request``, filled in by the engine's notification pump."""

    def __init__(self, engine: NixlEngine, req_id: int) -> None:
        self._engine = engine
        self._req_id = req_id
        self._reply: bytes | None = None
        self.error: str | None = None

    def poll(self) -> TransferState:
        """Non-blocking: pumps notifications, then "pending", "done" or "error"."""
        if self._reply is None and self.error is None:
            self._engine._pump()
            self._reply = self._engine._take_reply(self._req_id)
        if self.error is not None:
            return "error"
        return "pending" if self._reply is None else "done"

    def result(self) -> bytes:
        """The peer's reply; raises unless it arrived."""
        if self.poll() != "done" or self._reply is None:
            raise TransportError(f"request is not answered: {self.error or 'pending'}")
        return self._reply


class _Awaited:
    """A request of ours waiting for its reply, and the agent that may send it."""

    __slots__ = ("agent", "reply")

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.reply: bytes | None = None


class NixlIncoming:
    """A request received as a notification; ``reply`` answers with one."""

    __slots__ = ("payload", "sender", "_engine", "_address", "_req_id", "_replied")

    def __init__(self, payload: bytes, engine: NixlEngine, sender: str, address: bytes,
                 req_id: int) -> None:
        self.payload = payload
        self.sender = sender
        """The requester's NIXL agent name (the one NIXL says sent it; its address names it)."""
        self._engine = engine
        self._address = address
        self._req_id = req_id
        self._replied = False

    def reply(self, payload: bytes, *, vouched: bool = True) -> None:
        """Send the reply (once); logged and dropped when the requester cannot be reached.
        Not ``vouched``: sent only if the requester's agent is already loaded (its address is
        never loaded for it), else dropped and counted in ``unanswered_strangers``."""
        if self._replied:
            raise TransportError("request already answered")
        self._replied = True
        self._engine._reply(self.sender, self._address, self._req_id, payload, vouched)


class NixlLink:
    """A loaded remote NIXL agent (``NixlEngine.connect``)."""

    path = "nixl"
    path_reason: str | None = None

    def __init__(self, engine: NixlEngine, name: str, address: bytes) -> None:
        self._engine = engine
        self.name = name
        self._address = address  # to load the agent again after an eviction
        self._regions: list[tuple[str, int, int | None, int | None]] = []
        self._gets: weakref.WeakSet[NixlGet] = weakref.WeakSet()
        self._failed: str | None = None

    def unpack_rkey(self, packed: bytes, *, base: int | None = None,
                    length: int | None = None) -> int:
        """Record a remote region (its ``NixlRegion.rkey``); returns its index for ``get``."""
        if (base is None) != (length is None):
            raise ValueError("give both base and length, or neither")
        try:
            mem_type, device = bytes(packed).decode().split(":")
            self._regions.append((mem_type, int(device), base, length))
        except ValueError as exc:
            raise TransportError(f"bad NIXL region key {packed!r}") from exc
        return len(self._regions) - 1

    def get(self, ops: NDArray[np.int64] | NDArray[np.uint64]) -> NixlGet | _Done:
        """READ every (local, remote, nbytes, region index) row as one NIXL transfer."""
        arr = np.asarray(ops)
        if arr.ndim != 2 or arr.shape[1] != 4:
            raise ValueError(f"ops must have shape (n, 4), got {arr.shape}")
        if self._failed is not None:
            raise PeerUnreachable(f"peer {self.name} failed: {self._failed}")
        if len(arr) == 0:
            return _Done()
        rows = arr.astype(np.uint64)
        remote_kinds = set()
        for _, remote, nbytes, index in rows.tolist():
            if index >= len(self._regions):
                raise IndexError(f"unknown region index {index}")
            mem_type, device, base, length = self._regions[index]
            if base is not None and length is not None and not (
                    base <= remote and remote + nbytes <= base + length):
                raise ValueError(f"read of {nbytes} B at {remote:#x} outside remote region")
            remote_kinds.add((mem_type, device))
        if len(remote_kinds) != 1:
            raise TransportError(f"one READ spans remote memory kinds {sorted(remote_kinds)}")
        (remote_type, remote_device), = remote_kinds
        local_type, local_device = self._engine._local_kind(rows)
        local = np.stack([rows[:, 0], rows[:, 2], np.full(len(rows), local_device, np.uint64)],
                         axis=1)
        remote_descs = np.stack([rows[:, 1], rows[:, 2],
                                 np.full(len(rows), remote_device, np.uint64)], axis=1)
        handle, state = self._engine._post_read(local, local_type, remote_descs, remote_type,
                                                self.name, self._address)
        if state == "ERR":
            self._mark_failed("posting the READ failed")
        pending = NixlGet(self, handle, state)
        self._gets.add(pending)
        return pending

    def request(self, payload: bytes) -> NixlReply:
        """Send ``payload`` as a request notification; the reply arrives by notification."""
        if self._failed is not None:
            raise PeerUnreachable(f"peer {self.name} failed: {self._failed}")
        return self._engine._request(self, payload)

    def abort(self) -> None:
        """Cancel this link's READs and unload the peer (its endpoints close); idempotent."""
        for pending in list(self._gets):
            pending.cancel("aborted")
        self._mark_failed("aborted")

    def _mark_failed(self, reason: str) -> None:
        if self._failed is None:
            self._failed = reason
            self._engine._forget(self.name)

    @property
    def failed(self) -> bool:
        """True once a READ or a send failed, or after ``abort``."""
        return self._failed is not None


class NixlEngine:
    """One NIXL agent (UCX backend, no progress thread, NIXL-level locking) per engine.

    Locks: ``_agents_lock`` (reentrant) serialises loading, unloading and every use of a
    remote agent (posting a READ, sending a notification), so an agent is never unloaded
    between its check and its use; ``_lock`` guards the tables and is taken inside it, never
    around a NIXL call.
    """

    def __init__(self, *, name: str = "pdserve",
                 reads_expected: Callable[[], bool] | None = None,
                 max_loaded_agents: int = MAX_LOADED_AGENTS) -> None:
        if max_loaded_agents < 1:
            raise ValueError(f"max_loaded_agents must be at least 1, got {max_loaded_agents}")
        api = _nixl_api()
        self.agent_name = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            config = api.nixl_agent_config(
                enable_prog_thread=False, backends=["UCX"],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            with efa_module_skipped(nixl_module_dir()):  # loads and initialises its UCX
                self._agent: Any = api.nixl_agent(self.agent_name, config)
        except Exception as exc:  # nixl raises RuntimeError / its bindings' errors
            raise TransportError(f"NIXL init failed: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransportError("NIXL's UCX plugin is unavailable")
        self._reads_expected = reads_expected or (lambda: False)
        self._max_loaded = max_loaded_agents
        self._lock = threading.Lock()
        self._agents_lock = threading.RLock()
        self._pump_lock = threading.Lock()
        self._regions: list[NixlRegion] = []
        self._loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Remote agents loaded, least recently used first."""
        self._reads: collections.Counter[str] = collections.Counter()
        """READs posted and not yet settled, per remote agent (never unloaded meanwhile)."""
        self._requests: collections.deque[NixlIncoming] = collections.deque()
        self._replies: dict[int, _Awaited] = {}
        self._address: bytes | None = None
        self.dropped_messages = 0
        """Malformed notifications, replies nobody waits for, requests past the queue cap."""
        self.failed_replies = 0
        """Replies that could not be sent (requester unreachable)."""
        self.unanswered_strangers = 0
        """Replies dropped: not vouched for, and the requester's agent was not loaded."""
        self.foreign_messages = 0
        """Requests whose address names another agent than their sender, and replies from
        another agent than the one the request went to: dropped."""
        self.evicted_agents = 0
        """Remote agents unloaded to stay within ``max_loaded_agents``."""

    # ------------------------------------------------------------ Transport
    @property
    def address(self) -> bytes:
        """Agent name + metadata (connection info and every registered region)."""
        address = self._address
        if address is None:
            address = encode_address(self.agent_name, self._agent_call("get_agent_metadata"))
            self._address = address
        return address

    @property
    def locality(self) -> bytes:
        """Always b"": NIXL picks same-host transports (cma, shm) inside UCX itself."""
        return b""

    @property
    def loaded_agents(self) -> list[str]:
        """Names of the remote agents loaded now, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def register(self, addr: int, length: int, *, keepalive: object = None) -> NixlRegion:
        """Register memory with the UCX backend (DRAM, or VRAM for a CUDA ``keepalive``)."""
        mem_type, device = _mem_kind(keepalive)
        descs = self._agent_call("register_memory", [(int(addr), int(length), device, "")],
                                 mem_type)
        region = NixlRegion(int(addr), int(length), mem_type, device, descs, keepalive)
        with self._lock:
            self._regions.append(region)
            self._address = None  # the metadata now lists this region too
        return region

    def connect(self, peer_address: bytes, locality: bytes | None = None) -> NixlLink:
        """Load the peer's agent metadata (once per agent name while it stays loaded);
        ``locality`` is ignored."""
        try:
            name, _ = decode_address(peer_address)
            with self._agents_lock:
                self._load(name, peer_address)
        except TransportError as exc:
            raise PeerUnreachable(f"cannot connect: {exc}") from exc
        return NixlLink(self, name, peer_address)

    def poll_requests(self) -> list[NixlIncoming]:
        """Requests received so far (pumps notifications)."""
        self._pump()
        out = []
        with self._lock:
            while self._requests:
                out.append(self._requests.popleft())
        return out

    def wait_requests(self, timeout_s: float) -> bool:
        """Poll notifications until a request is queued or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._pump()
            with self._lock:
                if self._requests:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, HOT_POLL_S if self._reads_expected() else COLD_POLL_S))

    def close(self) -> None:
        """Deregister memory and drop the agent; idempotent. Later calls raise."""
        with self._lock:
            agent, self._agent = self._agent, None
            regions, self._regions = self._regions, []
        if agent is None:
            return
        for region in regions:
            try:
                agent.deregister_memory(region._descs)
            except Exception as exc:  # closing anyway
                logger.debug("NIXL deregister failed: %s", exc)
        del agent

    def __enter__(self) -> NixlEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _agent_call(self, method: str, *args: Any) -> Any:
        agent = self._agent
        if agent is None:
            raise TransportError("NIXL engine is closed")
        try:
            return getattr(agent, method)(*args)
        except TransportError:
            raise
        except Exception as exc:  # nixl's bindings raise their own exception types
            raise TransportError(f"NIXL {method} failed: {exc}") from exc

    def _touch(self, name: str) -> bool:
        """True when ``name`` is loaded (it becomes the most recently used)."""
        with self._lock:
            if name not in self._loaded:
                return False
            self._loaded.move_to_end(name)
            return True

    def _load(self, name: str, address: bytes) -> None:
        """Make ``name`` loaded from ``address`` unless it is (``_agents_lock`` held)."""
        if self._touch(name):
            return
        named, metadata = decode_address(address)
        if named != name:
            raise TransportError(f"address of agent {named} given for agent {name}")
        self._make_room()
        loaded = self._agent_call("add_remote_agent", metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            with self._lock:
                ours = loaded in self._loaded
            if not ours:  # do not keep endpoints to an agent nobody asked for
                self._unload(loaded)
            raise TransportError(f"address names agent {name} but its metadata {loaded}")
        with self._lock:
            self._loaded[name] = None

    def _make_room(self) -> None:
        """Unload least recently used agents without a READ in flight until one more fits
        (``_agents_lock`` held)."""
        while True:
            with self._lock:
                if len(self._loaded) < self._max_loaded:
                    return
                victim = next((n for n in self._loaded if not self._reads[n]), None)
                if victim is None:
                    break
                del self._loaded[victim]
                self.evicted_agents += 1
            logger.debug("unloading NIXL agent %s (least recently used)", victim)
            self._unload(victim)
        logger.warning("all %d loaded NIXL agents have READs in flight; loading one more",
                       self._max_loaded)

    def _unload(self, name: str) -> None:
        try:
            self._agent_call("remove_remote_agent", name)
        except TransportError as exc:
            logger.debug("unloading NIXL agent %s: %s", name, exc)

    def _forget(self, name: str) -> None:
        """Unload a failed or aborted peer so a later ``connect`` loads it afresh."""
        with self._agents_lock:
            with self._lock:
                if name not in self._loaded:
                    return
                del self._loaded[name]
            self._unload(name)

    def _read_settled(self, name: str) -> None:
        with self._lock:
            self._reads[name] -= 1
            if self._reads[name] <= 0:
                del self._reads[name]

    def _local_kind(self, rows: NDArray[np.uint64]) -> tuple[str, int]:
        with self._lock:
            regions = list(self._regions)
        kinds = set()
        for local, _, nbytes, _ in rows.tolist():
            region = next((r for r in regions if r.contains(local, nbytes)), None)
            if region is None:
                raise ValueError(f"local range {local:#x}+{nbytes} is not registered")
            kinds.add((region.mem_type, region.device))
        if len(kinds) != 1:
            raise TransportError(f"one READ spans local memory kinds {sorted(kinds)}")
        return kinds.pop()

    def _post_read(self, local: NDArray[np.uint64], local_type: str,
                   remote: NDArray[np.uint64], remote_type: str, peer: str,
                   address: bytes) -> tuple[Any, str]:
        """Post a READ from ``peer`` (loaded again from ``address`` if it was unloaded); the
        handle counts as in flight until ``_read_settled``."""
        with self._agents_lock:
            self._load(peer, address)
            local_descs = self._agent_call("get_xfer_descs", local, local_type)
            remote_descs = self._agent_call("get_xfer_descs", remote, remote_type)
            handle = self._agent_call("initialize_xfer", "READ", local_descs, remote_descs,
                                      peer)
            with self._lock:
                self._reads[peer] += 1
        try:
            return handle, self._agent_call("transfer", handle)
        except TransportError:
            try:
                self._agent_call("release_xfer_handle", handle)
            except TransportError as exc:
                logger.debug("releasing a READ that failed to post: %s", exc)
            self._read_settled(peer)
            raise

    def _new_request_id(self) -> int:
        """64 random bits, not pending now (``_lock`` held)."""
        while True:
            req_id = secrets.randbits(64)
            if req_id and req_id not in self._replies:
                return req_id

    def _request(self, link: NixlLink, payload: bytes) -> NixlReply:
        with self._lock:
            req_id = self._new_request_id()
            self._replies[req_id] = _Awaited(link.name)
        me = self.address
        message = _REQUEST + _REQ_HEAD.pack(req_id, len(me)) + me + payload
        reply = NixlReply(self, req_id)
        # A reply that never comes (its requester gave the request up) must not stay awaited
        # forever; dict.pop is atomic, and a finalizer must not take a lock it may run under.
        weakref.finalize(reply, self._replies.pop, req_id, None)
        try:
            with self._agents_lock:
                self._load(link.name, link._address)
                self._agent_call("send_notif", link.name, message)
        except TransportError as exc:
            self._replies.pop(req_id, None)
            link._mark_failed(str(exc))
            raise PeerUnreachable(str(exc)) from exc
        return reply

    def _take_reply(self, req_id: int) -> bytes | None:
        with self._lock:
            awaited = self._replies.get(req_id)
            if awaited is None or awaited.reply is None:
                return None
            del self._replies[req_id]
            return awaited.reply

    def _reply(self, sender: str, address: bytes, req_id: int, payload: bytes,
               vouched: bool) -> None:
        try:
            with self._agents_lock:
                if not self._touch(sender):
                    if not vouched:
                        self.unanswered_strangers += 1
                        logger.debug("reply dropped: agent %s is not loaded and the request "
                                     "was not vouched for", sender)
                        return
                    self._load(sender, address)
                self._agent_call("send_notif", sender, _REPLY + _REP_HEAD.pack(req_id) + payload)
        except TransportError as exc:
            self.failed_replies += 1
            logger.warning("reply dropped: requester unreachable: %s", exc)

    def _pump(self) -> None:
        """Progress the agent and sort new notifications into requests and replies."""
        if not self._pump_lock.acquire(blocking=False):
            return  # another thread is pumping right now
        try:
            try:
                notifs = self._agent_call("get_new_notifs")
            except TransportError as exc:
                logger.debug("notification poll failed: %s", exc)
                return
            for sender, messages in notifs.items():
                name = sender.decode() if isinstance(sender, bytes) else str(sender)
                for message in messages:
                    self._sort(name, bytes(message))
        finally:
            self._pump_lock.release()

    def _sort(self, sender: str, message: bytes) -> None:
        """File one notification from agent ``sender`` (``_pump_lock`` held)."""
        kind, body = message[:1], message[1:]
        try:
            if kind == _REQUEST:
                req_id, n = _REQ_HEAD.unpack_from(body)
                start = _REQ_HEAD.size
                address = body[start:start + n]
                if len(address) == n and self._queue_request(sender, address, req_id,
                                                             body[start + n:]):
                    return
            elif kind == _REPLY:
                (req_id,) = _REP_HEAD.unpack_from(body)
                with self._lock:
                    awaited = self._replies.get(req_id)
                    if awaited is not None and awaited.agent != sender:
                        self.foreign_messages += 1
                        return
                    if awaited is not None and awaited.reply is None:
                        awaited.reply = body[_REP_HEAD.size:]
                        return
        except struct.error:
            pass
        self.dropped_messages += 1

    def _queue_request(self, sender: str, address: bytes, req_id: int, payload: bytes) -> bool:
        """Queue a request whose address names its sender (one naming another agent is
        counted in ``foreign_messages``); False when it is to be counted dropped (a malformed
        address, or the queue is full)."""
        try:
            named, _ = decode_address(address)
        except TransportError:
            return False
        if named != sender:
            self.foreign_messages += 1
            return True
        with self._lock:
            if len(self._requests) >= MAX_QUEUED_REQUESTS:
                return False
            self._requests.append(NixlIncoming(payload, self, sender, address, req_id))
        return True
