"""Checks on the ``kv_transfer_params`` a prefill worker answers, before the router signs them.

The router's signature is what makes a decode read KV, so it must vouch only for params that
describe the prefill the router chose: its engine id and its UCX address as registered. A
rogue or confused worker (a forged registration, a mix-up of engines) could otherwise point
decodes at an address of its choosing.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from kvtransfer.errors import HandshakeError
from kvtransfer.protocol import REMOTE_ENGINE_ID, REMOTE_HANDSHAKE, Handshake
from router.state.registry import WorkerRecord


def foreign_kv_params(params: dict[str, Any], worker: WorkerRecord) -> str | None:
    """None when ``params`` name ``worker``'s own engine and UCX address (its registry
    record); else why not."""
    engine = params.get(REMOTE_ENGINE_ID)
    if engine != worker.engine_id:
        return f"engine id {engine!r} is not the registered {worker.engine_id!r}"
    try:
        handshake = Handshake.from_wire(str(params.get(REMOTE_HANDSHAKE)))
    except HandshakeError as exc:
        return str(exc)
    if handshake.engine_id != worker.engine_id:
        return f"handshake of engine {handshake.engine_id!r}"
    try:
        registered = base64.b64decode(worker.ucx_address, validate=True)
    except (binascii.Error, ValueError):
        return "the registry record's UCX address is not base64"
    if handshake.ucx_address != registered:
        return "handshake UCX address differs from the registered one"
    return None
