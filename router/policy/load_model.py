"""Predicted TTFT of a prefill candidate from its queued uncached tokens.

Parameters (defaults):
- ``per_token_s`` = 1e-4: prefill seconds per uncached prompt token (about 10k tokens/s, an 8B
  model on one A100/H100-class GPU; DualMap's authors measured 1.6e-4 for Qwen2.5-7B on an Ascend
  910B4). Calibrate from a measured profile.
- ``cached_token_s`` = 0.0: cost of a cached (reused) token; the reference code's ``tprt`` = 0.
- ``overhead_s`` = 0.0: fixed per-prediction overhead (a batch step's launch cost).

``TTFT_est = overhead_s + (queued uncached tokens + this request's uncached tokens) x per_token_s
+ this request's cached tokens x cached_token_s``: the work ahead of the request plus its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.errors import ConfigError


@dataclass(frozen=True)
class LoadModel:
    """Linear prefill cost model."""

    per_token_s: float = 1e-4
    """Prefill seconds per uncached prompt token."""
    cached_token_s: float = 0.0
    """Seconds per cached prompt token (reading reused KV)."""
    overhead_s: float = 0.0
    """Fixed seconds added to every prediction."""

    def __post_init__(self) -> None:
        if self.per_token_s <= 0:
            raise ConfigError(f"per_token_s must be > 0, got {self.per_token_s}")
        if self.cached_token_s < 0 or self.overhead_s < 0:
            raise ConfigError("cached_token_s and overhead_s must be >= 0")

    def ttft_s(self, pending_tokens: int, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted TTFT of a request with ``uncached_tokens`` behind ``pending_tokens``."""
        return (self.overhead_s + (pending_tokens + uncached_tokens) * self.per_token_s
                + cached_tokens * self.cached_token_s)

    def queue_s(self, pending_tokens: int) -> float:
        """Predicted time to drain ``pending_tokens`` (an instance's own predicted TTFT)."""
        return self.overhead_s + pending_tokens * self.per_token_s
