"""Selective disaggregation: which requests skip the prefill hop (pure, hand-computed)."""

from __future__ import annotations

import pytest

from router.policy.base import Dispatched, Membership, RouteRequest
from router.policy.disagg import SelectiveDisaggregation
from router.policy.hashing import block_hashes


def _req(tokens: list[int], rid: str = "r") -> RouteRequest:
    return RouteRequest(request_id=rid, model="m", prompt_token_ids=tuple(tokens),
                        block_hashes=block_hashes(tokens))


def test_threshold_zero_always_disaggregates() -> None:
    d = SelectiveDisaggregation(0)
    assert not d.enabled
    assert d.decide(_req([1, 2, 3]), "d1").path == "pd"


@pytest.mark.parametrize(("prompt_len", "path", "reason"), [
    (10, "decode_only", "short_prompt"),
    (63, "decode_only", "short_prompt"),
    (64, "pd", "long_uncached_prompt"),
    (500, "pd", "long_uncached_prompt"),
])
def test_short_prompts_skip_the_prefill(prompt_len: int, path: str, reason: str) -> None:
    choice = SelectiveDisaggregation(64).decide(_req(list(range(prompt_len))), "d1")
    assert (choice.path, choice.reason, choice.cached_tokens) == (path, reason, 0)


def test_a_prefix_the_decode_worker_holds_counts_as_cached() -> None:
    d = SelectiveDisaggregation(64)
    long = list(range(200))
    d.observe(Dispatched("a", "d1", "m", _req(long, "a")))
    follow_up = _req([*long, 7, 8, 9], "b")  # 203 tokens, 192 of them (12 blocks) on d1
    on_d1 = d.decide(follow_up, "d1")
    assert (on_d1.path, on_d1.reason, on_d1.cached_tokens) == ("decode_only",
                                                               "cached_on_decode", 192)
    assert d.decide(follow_up, "d2").path == "pd"  # negative control: d2 never saw it
    d.observe(Membership("m", ("d2",)))  # d1 left: its cache estimate goes with it
    assert d.decide(follow_up, "d1").path == "pd"


def test_rejects_a_negative_threshold() -> None:
    with pytest.raises(ValueError):
        SelectiveDisaggregation(-1)
