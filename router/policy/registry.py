"""Policy names -> factories. New policies register here under a stable name."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.errors import ConfigError
from router.policy.base import PlacementPolicy
from router.policy.least_loaded import LeastLoadedPolicy
from router.policy.round_robin import RoundRobinPolicy

PolicyFactory = Callable[[], PlacementPolicy]

PREFILL_POLICIES: Mapping[str, PolicyFactory] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
}
DECODE_POLICIES: Mapping[str, PolicyFactory] = {
    "least_loaded": LeastLoadedPolicy,
    "round_robin": RoundRobinPolicy,
}


def create_prefill_policy(name: str) -> PlacementPolicy:
    try:
        return PREFILL_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown prefill policy {name!r}; allowed: {', '.join(sorted(PREFILL_POLICIES))}"
        ) from None


def create_decode_policy(name: str) -> PlacementPolicy:
    try:
        return DECODE_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown decode policy {name!r}; allowed: {', '.join(sorted(DECODE_POLICIES))}"
        ) from None
