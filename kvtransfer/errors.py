"""Exception tree of the KV transfer layer.

    KVTransferError
     +-- ConfigError          bad connector configuration
     +-- HandshakeError       a peer's handshake is malformed or incompatible
     +-- TransportError       UCX failed (the native layer's error text is kept)
          +-- PeerUnreachable the peer's endpoint could not be created or died
          +-- TransferTimeout a transfer passed its deadline (the peer was aborted)
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Root of every error raised by kvtransfer."""


class ConfigError(KVTransferError):
    """The connector configuration is invalid."""


class HandshakeError(KVTransferError):
    """A peer's handshake payload is malformed or incompatible with ours."""


class TransportError(KVTransferError):
    """The UCX transport reported a failure."""


class PeerUnreachable(TransportError):
    """The peer could not be reached or its endpoint failed."""


class TransferTimeout(TransportError):
    """A transfer did not complete before its deadline."""
