"""What every placement policy may know about its deployment, and parameter checking.

A :class:`PolicyContext` is built once by the caller (the router from its settings, the
simulator from its performance model) and handed to every policy factory
(:mod:`router.policy.registry`), as llm-d hands its scheduler plugins a handle. A factory takes
the context plus the policy's own parameters (a mapping, e.g. parsed from JSON or ``key=value``
flags), keeps the context values it uses as defaults, lets the parameters override them and
rejects parameters it does not know.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from router.errors import ConfigError
from router.policy.cache_model import DEFAULT_CAPACITY_BLOCKS
from router.policy.hashing import DEFAULT_BLOCK_TOKENS


@dataclass(frozen=True)
class PolicyContext:
    """The SLO, the cost model and the cache geometry shared by the policies of one router."""

    ttft_slo_s: float = 5.0
    """TTFT SLO in seconds (DualMap's switch threshold is a fraction of it)."""
    per_token_s: float = 1e-4
    """Predicted prefill seconds per uncached prompt token."""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Tokens per hashed prefix-cache block (must match the router's and vLLM's hashing)."""
    cache_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    """Prefix-cache size per instance, in blocks (for router-side cache models)."""

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.per_token_s <= 0:
            raise ConfigError("ttft_slo_s and per_token_s must be > 0")
        if self.block_tokens <= 0 or self.cache_capacity_blocks <= 0:
            raise ConfigError("block_tokens and cache_capacity_blocks must be > 0")


def checked(policy: str, params: Mapping[str, Any], known: Collection[str]) -> dict[str, Any]:
    """``params`` as a dict; a ConfigError naming ``policy`` when one of them is not ``known``."""
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(f"policy {policy!r} has no parameter {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known)) or 'none'}")
    return dict(params)
