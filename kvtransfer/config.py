"""Typed configuration of the pdserve KV connector (from ``kv_connector_extra_config``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtransfer.errors import ConfigError


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of one connector instance; every field has a laptop-friendly default."""

    transport: str = "ucx"
    """KV wire: ``ucx`` (our UCX RMA engine with the same-host path), ``tcp`` (sealed:
    authenticated connections and server-checked pulls, :mod:`kvtransfer.transport.tcp`; the
    wire for networks others share) or ``nixl`` (NIXL READs and notifications, see
    :mod:`kvtransfer.transport.nixl`); the lease protocol is the same (PDSERVE_KV_TRANSPORT)."""
    tcp_host: str = "127.0.0.1"
    """``tcp`` transport: the address its listener binds (the worker's ``--host``)."""
    tcp_advertise_host: str | None = None
    """``tcp`` transport: the host peers dial (the worker's ``--advertise-host``); None: the
    bind address, or for a wildcard the host name's addresses, then loopback."""
    lease_s: float = 30.0
    """How long a prefill worker keeps a finished request's blocks for a decode pull."""
    pull_timeout_s: float = 20.0
    """Deadline of one pull (RMA reads + the release round trip); past it the load fails."""
    handshake_file: str | None = None
    """If set, the scheduler half writes the handshake (UCX address, engine id) here as JSON."""
    timeline_file: str | None = None
    """If set, every completed request's connector timeline (wall-clock events and phase
    durations, see :mod:`kvtransfer.timeline`) is appended here as one JSON line."""
    signing_keys_file: str | None = None
    """Cluster keyring (one secret per line, see :mod:`kvtransfer.signing`): when set, only
    router-signed ``kv_transfer_params`` may lease blocks or start a pull; re-read on change."""
    signature_max_age_s: float = 120.0
    """Signed params older than this (or as far in the future) are refused as stale."""
    corrupt_pulled_kv_file: str | None = None
    """Test-only negative control: while this file exists, pulled blocks are overwritten with
    noise after each pull (proves that output equality tests can fail)."""
    same_host: bool = True
    """Read same-host peers with process_vm_readv (env PDSERVE_KV_SAME_HOST=0 turns it off)."""
    pvm_threads: int = 0
    """Same-host reader threads; 0: 2 when 2+ CPUs are usable, else 1 (PDSERVE_KV_PVM_THREADS)."""
    pvm_chunk_kib: int = 4096
    """KiB per same-host read batch (PDSERVE_KV_PVM_CHUNK_KIB)."""
    thp: str = "collapse"
    """Huge pages for registered host KV memory: collapse | advise | off (PDSERVE_KV_THP)."""
    ucx_wakeup: bool = True
    """The UCX progress thread sleeps on the worker's event fd when idle; off: short sleeps,
    which let event-less transports (cma) carry RMA (PDSERVE_UCX_WAKEUP=0)."""
    ucx_spin_us: float = 200.0
    """The UCX progress thread keeps polling this long after its last event, in microseconds
    (PDSERVE_UCX_SPIN_US)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {list(TRANSPORTS)}, "
                              f"got {self.transport!r}")
        if self.lease_s <= 0:
            raise ConfigError(f"lease_s must be > 0, got {self.lease_s}")
        if self.signature_max_age_s <= 0:
            raise ConfigError(f"signature_max_age_s must be > 0, got {self.signature_max_age_s}")
        if self.pull_timeout_s <= 0:
            raise ConfigError(f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")
        if self.thp not in THP_MODES:
            raise ConfigError(f"thp must be one of {list(THP_MODES)}, got {self.thp!r}")
        if self.pvm_threads < 0 or self.pvm_chunk_kib <= 0 or self.ucx_spin_us < 0:
            raise ConfigError("pvm_threads must be >= 0, pvm_chunk_kib > 0, ucx_spin_us >= 0")

    def ucx_options(self) -> dict[str, Any]:
        """Keyword arguments of `kvtransfer.transport.ucx.UcxEngine` from these settings."""
        return {"same_host": self.same_host, "pvm_threads": self.pvm_threads,
                "pvm_chunk_kib": self.pvm_chunk_kib, "thp": self.thp,
                "wakeup": self.ucx_wakeup, "spin_us": self.ucx_spin_us}

    def tcp_options(self) -> dict[str, Any]:
        """Keyword arguments of `kvtransfer.transport.tcp.TcpEngine`: where to listen, and the
        cluster secrets that connections must prove (re-read on change, like signing's)."""
        keys = None
        if self.signing_keys_file:
            from kvtransfer.signing import KeyringFile

            keyring = KeyringFile(self.signing_keys_file)
            keys = lambda: keyring.current().wire_keys  # noqa: E731
        return {"bind_host": self.tcp_host, "advertise_host": self.tcp_advertise_host,
                "keys": keys}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None,
                          environ: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config`` dict, rejecting unknown keys.

        Transport knobs not given there default to their ``PDSERVE_*`` variables (`ENV_KNOBS`).
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; "
                              f"allowed: {sorted(known)}")
        env = os.environ if environ is None else environ
        for name, (var, parse) in ENV_KNOBS.items():
            if name not in extra and env.get(var, "") != "":
                try:
                    extra[name] = parse(env[var])
                except ValueError as exc:
                    raise ConfigError(f"{var}={env[var]!r}: {exc}") from exc
        try:
            return cls(**extra)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc


THP_MODES = ("collapse", "advise", "off")
TRANSPORTS = ("ucx", "tcp", "nixl")


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off")


ENV_KNOBS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "transport": ("PDSERVE_KV_TRANSPORT", str.strip),
    "same_host": ("PDSERVE_KV_SAME_HOST", _flag),
    "pvm_threads": ("PDSERVE_KV_PVM_THREADS", int),
    "pvm_chunk_kib": ("PDSERVE_KV_PVM_CHUNK_KIB", int),
    "thp": ("PDSERVE_KV_THP", lambda v: "off" if v == "0" else v),
    "ucx_wakeup": ("PDSERVE_UCX_WAKEUP", _flag),
    "ucx_spin_us": ("PDSERVE_UCX_SPIN_US", float),
}
"""Connector fields whose default comes from an environment variable (name, parser)."""
