"""Policy names -> factories. New policies register here under a stable name.

The names are the same everywhere (router ``--policy``, simulator ``--policies``, JSON, plots).
Factories take keyword parameters (the simulator passes the SLO and the cost model); the router
calls them with the settings it has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.errors import ConfigError
from router.policy.base import PlacementPolicy
from router.policy.bounded_load_hash import BoundedLoadHashPolicy
from router.policy.consistent_hash import ConsistentHashPolicy
from router.policy.decode_choice import DecodeChoicePolicy
from router.policy.dualmap import DualMapPolicy
from router.policy.least_loaded import LeastLoadedPolicy
from router.policy.prefix_only import PrefixOnlyPolicy
from router.policy.round_robin import RoundRobinPolicy

PolicyFactory = Callable[..., PlacementPolicy]

PREFILL_POLICIES: Mapping[str, PolicyFactory] = {
    "dualmap": DualMapPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "consistent_hash": ConsistentHashPolicy,
    "bounded_load_hash": BoundedLoadHashPolicy,
    "prefix_only": PrefixOnlyPolicy,
}
DECODE_POLICIES: Mapping[str, PolicyFactory] = {
    "least_loaded": LeastLoadedPolicy,
    "round_robin": RoundRobinPolicy,
    "kv_aware": DecodeChoicePolicy,
}
BASELINES = ("round_robin", "least_loaded", "consistent_hash", "bounded_load_hash",
             "prefix_only")
"""The prefill baselines DualMap is compared against, in report order."""


def create_prefill_policy(name: str, **params: Any) -> PlacementPolicy:
    """A new prefill policy; ``params`` go to its constructor (DualMap takes the SLO etc.)."""
    try:
        factory = PREFILL_POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown prefill policy {name!r}; allowed: {', '.join(sorted(PREFILL_POLICIES))}"
        ) from None
    return factory(**params)


def create_decode_policy(name: str, **params: Any) -> PlacementPolicy:
    """A new decode policy."""
    try:
        factory = DECODE_POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown decode policy {name!r}; allowed: {', '.join(sorted(DECODE_POLICIES))}"
        ) from None
    return factory(**params)
