"""Policy names -> factories. New policies register here under a stable name.

The names are the same everywhere (router ``--policy``, simulator ``--policies``, JSON, plots).
A factory is the policy's own ``from_context(context, params)``: it takes what it needs from
the :class:`~router.policy.context.PolicyContext` (SLO, per-token cost, cache geometry) and
parses its own parameters, rejecting unknown ones, as llm-d's scheduler plugins do. Callers
never special-case a policy by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.errors import ConfigError
from router.policy.base import PlacementPolicy
from router.policy.bounded_load_hash import BoundedLoadHashPolicy
from router.policy.consistent_hash import ConsistentHashPolicy
from router.policy.context import PolicyContext
from router.policy.decode_choice import DecodeChoicePolicy
from router.policy.dualmap import DualMapPolicy
from router.policy.least_loaded import LeastLoadedPolicy
from router.policy.peers.aibrix_prefix import AibrixPrefixPolicy
from router.policy.peers.dynamo_kv import DynamoKvPolicy
from router.policy.peers.llmd_default import LlmdDefaultPolicy
from router.policy.peers.preble_e2 import PrebleE2Policy
from router.policy.peers.sglang_cache_aware import SGLangCacheAwarePolicy
from router.policy.prefix_only import PrefixOnlyPolicy
from router.policy.round_robin import RoundRobinPolicy

PolicyFactory = Callable[[PolicyContext, Mapping[str, Any]], PlacementPolicy]

PREFILL_POLICIES: Mapping[str, PolicyFactory] = {
    "dualmap": DualMapPolicy.from_context,
    "round_robin": RoundRobinPolicy.from_context,
    "least_loaded": LeastLoadedPolicy.from_context,
    "consistent_hash": ConsistentHashPolicy.from_context,
    "bounded_load_hash": BoundedLoadHashPolicy.from_context,
    "prefix_only": PrefixOnlyPolicy.from_context,
    "sglang_cache_aware": SGLangCacheAwarePolicy.from_context,
    "llmd_default": LlmdDefaultPolicy.from_context,
    "dynamo_kv": DynamoKvPolicy.from_context,
    "aibrix_prefix": AibrixPrefixPolicy.from_context,
    "preble_e2": PrebleE2Policy.from_context,
}
DECODE_POLICIES: Mapping[str, PolicyFactory] = {
    "least_loaded": LeastLoadedPolicy.from_context,
    "round_robin": RoundRobinPolicy.from_context,
    "kv_aware": DecodeChoicePolicy.from_context,
}
BASELINES = ("round_robin", "least_loaded", "consistent_hash", "bounded_load_hash",
             "prefix_only")
"""The prefill baselines DualMap is compared against, in report order."""
PEERS = ("sglang_cache_aware", "llmd_default", "dynamo_kv", "aibrix_prefix", "preble_e2")
"""The field's routers re-implemented as placement policies (:mod:`router.policy.peers`),
in report order."""


def _create(kind: str, table: Mapping[str, PolicyFactory], name: str,
            context: PolicyContext | None, params: Mapping[str, Any]) -> PlacementPolicy:
    try:
        factory = table[name]
    except KeyError:
        raise ConfigError(
            f"unknown {kind} policy {name!r}; allowed: {', '.join(sorted(table))}") from None
    return factory(context or PolicyContext(), params)


def create_prefill_policy(name: str, context: PolicyContext | None = None,
                          **params: Any) -> PlacementPolicy:
    """A new prefill policy built by its factory from ``context`` (default: the defaults)
    and its own ``params``."""
    return _create("prefill", PREFILL_POLICIES, name, context, params)


def create_decode_policy(name: str, context: PolicyContext | None = None,
                         **params: Any) -> PlacementPolicy:
    """A new decode policy built by its factory from ``context`` and its own ``params``."""
    return _create("decode", DECODE_POLICIES, name, context, params)
