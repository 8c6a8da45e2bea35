"""The router's listening socket, owned by ``pdserve up`` rather than by the router process.

The supervisor binds it once and hands it to every router it starts (``--listen-fd``). While a
router restarts (crash, SIGTERM, chaos' ``router_restart``) the socket stays open in the
supervisor, so the kernel keeps completing clients' connections into its backlog and the next
router accepts them: a restart costs the client a second of latency, not a refused connect.
"""

from __future__ import annotations

import socket

BACKLOG = 4096
"""Connections the kernel holds for the next router (capped by net.core.somaxconn)."""


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` as uvicorn binds it (``SO_REUSEADDR``, the address
    family ``host`` resolves to); raises OSError when the address is taken or unresolvable."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """:func:`bound_socket`, listening and inheritable by child processes; raises OSError
    when the address is taken."""
    sock = bound_socket(host, port)
    try:
        sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
