"""The transport contract the KV connector codes against (``open_transport`` in
``kvtransfer.transport.factory`` chooses one).

A transport moves KV bytes one-sidedly (the decode reads the prefill's registered blocks; the
prefill's CPU is not on the data path) and carries the small request/reply messages of the
lease protocol (decode -> prefill "done <request id>", prefill -> decode "ok" / "expired").
Leases, releases, expiry and recompute live above it, in ``kvtransfer.connector.worker`` and
``kvtransfer.leases``, so every transport gets them unchanged.

Implementations (``ConnectorConfig.transport``): ``ucx`` (``kvtransfer.transport.ucx.UcxEngine``:
our native UCX RMA engine, with a same-host process_vm_readv path) and ``nixl``
(``kvtransfer.transport.nixl.NixlEngine``: NIXL agents, READ transfers, NIXL notifications).
``UcxEngine`` satisfies these protocols as it is; they were written from its API.

Who calls what, on which thread (the connector's worker half):
  - engine thread, once: ``factory.open_transport(config)``, ``register`` every KV region, then read
    ``address`` and ``locality`` into the handshake.
  - engine thread, per step: ``connect`` (once per remote engine, cached by the caller),
    ``Link.unpack_rkey`` (once per remote region), ``Link.get``, ``Link.request``,
    ``Pending.poll``, ``Link.abort`` after a missed deadline.
  - responder thread (prefill side): ``wait_requests`` / ``poll_requests`` and
    ``Incoming.reply``. Both threads may use one engine at once: engines must be thread-safe.
  - teardown: ``close``.
Failures surface as ``Pending.poll() == "error"`` or as ``kvtransfer.errors.TransportError``
subclasses; the connector turns either into a load error (vLLM recomputes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

TransferState = Literal["pending", "done", "error"]


class RegisteredRegion(Protocol):
    """Memory registered with a transport for remote reads."""

    @property
    def rkey(self) -> bytes:
        """What a peer needs besides the address to read this region (may be empty when the
        engine ``address`` already carries it, as NIXL's agent metadata does)."""
        ...


class Pending(Protocol):
    """Completion handle of a ``get`` or a ``request``."""

    def poll(self) -> TransferState:
        """Non-blocking state; may drive the transport's progress."""
        ...

    def result(self) -> bytes:
        """The reply of a ``request`` (b"" for a ``get``); raises unless done."""
        ...

    @property
    def error(self) -> str | None:
        """The transport's error text once failed, else None."""
        ...


class Incoming(Protocol):
    """A request received from a peer; answered once."""

    payload: bytes

    def reply(self, payload: bytes, *, vouched: bool = True) -> None:
        """Send the answer; a requester that is gone is logged, not raised.

        ``vouched`` says the request proved itself (it carried the token of a lease this engine
        granted), so the transport may open a connection to the requester to answer it. When
        False, a transport whose reply goes to an address the request itself names (ucx, nixl)
        answers only a requester it is already connected to and otherwise drops the reply
        (counted): an unproven request must not make the engine connect anywhere (security
        review finding 15). A transport answering on the request's own connection (tcp)
        ignores it."""
        ...


class Link(Protocol):
    """A connection to one remote engine (``Transport.connect``)."""

    def unpack_rkey(self, packed: bytes, *, base: int | None = None,
                    length: int | None = None) -> int:
        """Make a remote region readable; returns the index for column 3 of ``get`` ops. With
        ``base``/``length`` every op is checked to stay inside the region (UCX requires them:
        its server serves any address)."""
        ...

    def get(self, ops: NDArray[np.int64] | NDArray[np.uint64]) -> Pending:
        """Read remote bytes: (n, 4) rows (local addr, remote addr, nbytes, region index).
        Completes when every row landed; never a partial success."""
        ...

    def request(self, payload: bytes) -> Pending:
        """Send a request; ``Pending.result()`` is the peer's reply."""
        ...

    def abort(self) -> None:
        """Give the peer up: outstanding gets end in error and must not write afterwards."""
        ...

    @property
    def failed(self) -> bool:
        """True once the transport saw the peer fail (the caller reconnects)."""
        ...

    @property
    def path(self) -> str:
        """How ``get`` reads ("pvm" for the same-host path, "ucx", "nixl")."""
        ...

    @property
    def path_reason(self) -> str | None:
        """Why the same-host path is not used, if that is interesting, else None."""
        ...


class Transport(Protocol):
    """One engine's transport endpoint: registered memory, links and a request inbox."""

    @property
    def address(self) -> bytes:
        """Blob peers pass to ``connect``; read it after the last ``register``."""
        ...

    @property
    def locality(self) -> bytes:
        """Same-host identity shipped next to ``address`` (b"" if the transport has none)."""
        ...

    def register(self, addr: int, length: int, *, keepalive: object = None) -> RegisteredRegion:
        """Register existing memory until ``close``; ``keepalive`` is referenced meanwhile."""
        ...

    def connect(self, peer_address: bytes, locality: bytes | None = None) -> Link:
        """Open a link to the engine whose ``address`` is given; raises PeerUnreachable."""
        ...

    def poll_requests(self) -> Sequence[Incoming]:
        """Requests received so far (non-blocking)."""
        ...

    def wait_requests(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a request; True if one is queued."""
        ...

    def close(self) -> None:
        """Release everything; idempotent. Pending handles turn to errors."""
        ...
