"""Typed configuration of the pdserve KV connector (from ``kv_connector_extra_config``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvtransfer.errors import ConfigError


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of one connector instance; every field has a laptop-friendly default."""

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

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ConfigError(f"lease_s must be > 0, got {self.lease_s}")
        if self.signature_max_age_s <= 0:
            raise ConfigError(f"signature_max_age_s must be > 0, got {self.signature_max_age_s}")
        if self.pull_timeout_s <= 0:
            raise ConfigError(f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config`` dict, rejecting unknown keys."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; "
                              f"allowed: {sorted(known)}")
        try:
            return cls(**extra)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc
