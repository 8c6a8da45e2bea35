"""KV transport: one-sided pulls (UCX RMA, or process_vm_readv on the same host; see `ucx.py`)."""

from kvtransfer.errors import KVTransferError, PeerUnreachable, TransferTimeout, TransportError
from kvtransfer.transport.ucx import IncomingRequest, Peer, Region, Transfer, UcxEngine

__all__ = [
    "IncomingRequest",
    "KVTransferError",
    "Peer",
    "PeerUnreachable",
    "Region",
    "Transfer",
    "TransferTimeout",
    "TransportError",
    "UcxEngine",
]
