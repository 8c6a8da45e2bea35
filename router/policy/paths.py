"""Which path serves a request when the fleet holds no prefill + decode pair (pure).

Any worker that can run the model serves the whole request: a plain (aggregated) worker first,
else a decode worker (it computes the prompt itself), else a prefill worker (a complete vLLM: a
request that does not ask it to lease is served like on a plain server). A pool whose only
worker is restarting therefore costs its requests the disaggregation, not the answer.
"""

from __future__ import annotations

from collections.abc import Collection

WHOLE_PATHS: dict[str, tuple[str, str]] = {
    "aggregated": ("aggregated", "no_pd_pool"),
    "flex": ("whole", "no_pd_pool"),
    "decode": ("decode_only", "no_prefill_worker"),
    "prefill": ("prefill_whole", "no_decode_worker"),
}
"""Role -> (path, reason) of ``pdserve_router_paths_total`` for a request it serves whole."""


def whole_request_role(roles: Collection[str]) -> str:
    """The role that serves whole requests among live ``roles`` (no prefill + decode pair);
    ValueError when there is none."""
    for role in WHOLE_PATHS:
        if role in roles:
            return role
    raise ValueError(f"no worker role among {sorted(roles)}")
