"""Admission control verdicts, computed by hand."""

from __future__ import annotations

import pytest

from router.policy.admission import AdmissionLimits, admit
from router.policy.base import Candidate


def _pool(*loads: tuple[int, int, int]) -> list[Candidate]:
    return [Candidate(f"w{i}", in_flight=f, running=r, pending_prefill_tokens=t)
            for i, (f, r, t) in enumerate(loads)]


def test_everything_is_admitted_by_default_and_empty_pools_pass() -> None:
    assert admit(_pool((500, 500, 10**9)), AdmissionLimits(), prefill=True).admit
    assert admit([], AdmissionLimits(max_in_flight_per_worker=1), prefill=True).admit


def test_in_flight_bound_needs_every_worker_full() -> None:
    limits = AdmissionLimits(max_in_flight_per_worker=4)
    assert admit(_pool((4, 0, 0), (3, 0, 0)), limits, prefill=False).admit
    # running reported by the worker counts too (requests from elsewhere)
    verdict = admit(_pool((4, 0, 0), (1, 4, 0)), limits, prefill=False)
    assert not verdict.admit and verdict.retry_after_s == 1 and "4" in verdict.reason


@pytest.mark.parametrize(("tokens", "admitted", "retry"), [
    # bar = 2 x 1 s; 1 ms per token: 2000 tokens wait 2 s (admitted), 2500 wait 2.5 s
    ((2000, 9000), True, 0), ((2500, 9000), False, 1), ((5200, 6000), False, 4)])
def test_queue_bound_uses_the_shortest_queue(tokens: tuple[int, int], admitted: bool,
                                             retry: int) -> None:
    limits = AdmissionLimits(queue_slo_factor=2.0, ttft_slo_s=1.0, per_token_s=1e-3)
    verdict = admit(_pool((0, 0, tokens[0]), (0, 0, tokens[1])), limits, prefill=True)
    assert verdict.admit is admitted
    assert verdict.retry_after_s == retry
    # decode pools have no prefill queue
    assert admit(_pool((0, 0, tokens[0])), limits, prefill=False).admit


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        AdmissionLimits(max_in_flight_per_worker=-1)
    with pytest.raises(ValueError):
        AdmissionLimits(ttft_slo_s=0)
