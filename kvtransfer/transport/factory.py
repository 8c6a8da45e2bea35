"""Choose and open the KV transport ``ConnectorConfig.transport`` names (the one module that
knows every implementation; ``base`` holds only the contract they satisfy)."""

from __future__ import annotations

from collections.abc import Callable

from kvtransfer.config import TRANSPORTS, ConnectorConfig
from kvtransfer.errors import ConfigError
from kvtransfer.transport.base import Transport


def open_transport(config: ConnectorConfig, *, label: str,
                   reads_expected: Callable[[], bool] | None = None) -> Transport:
    """Create the transport ``config.transport`` (one of ``TRANSPORTS``) for one engine.

    ``label`` names the engine in logs and peer tables (unique per process). ``reads_expected``
    tells a transport without its own progress thread (nixl) when remote reads of our memory
    may be in flight (a lease is active), so it can serve them promptly and idle otherwise.
    """
    if config.transport == "ucx":
        from kvtransfer.transport.ucx import UcxEngine

        return UcxEngine(name=label, **config.ucx_options())
    if config.transport == "tcp":
        from kvtransfer.transport.tcp import TcpEngine

        return TcpEngine(name=label, **config.tcp_options())
    if config.transport == "nixl":
        from kvtransfer.transport.nixl import NixlEngine

        return NixlEngine(name=label, reads_expected=reads_expected)
    raise ConfigError(f"unknown KV transport {config.transport!r}; allowed: {list(TRANSPORTS)}")
