"""Attention's square term in a prefill's cost: fitted by the profile, read by the cost model,
charged by the simulator's colocated engines after the context each chunk attends to."""

from __future__ import annotations

import pytest

from bench.profile import profile_document
from bench.sim.colocated import ColocatedEngine
from router.autoscale.profile import InstanceProfile, fit_quadratic
from router.policy.path_cost import PathCosts

A, B, C = 0.012, 4e-5, 2e-8
LENGTHS = (32, 128, 512, 1024, 2048, 3072)


def _curve(n: float) -> float:
    return A + B * n + C * n * n


def test_fit_quadratic_recovers_a_bent_curve_and_keeps_a_line_straight() -> None:
    a, b, c = fit_quadratic([(n, _curve(n)) for n in LENGTHS])
    assert (a, b, c) == pytest.approx((A, B, C), rel=1e-6)
    # control: points on a line get no square term
    a, b, c = fit_quadratic([(n, A + B * n) for n in LENGTHS])
    assert c == pytest.approx(0.0, abs=1e-15) and (a, b) == pytest.approx((A, B), rel=1e-6)


def test_fit_quadratic_never_returns_a_negative_term() -> None:
    # a curve that flattens (concave) would fit a negative square term; the fit drops it
    points = [(n, A + 2 * B * n - C * n * n) for n in LENGTHS]
    coef = fit_quadratic(points)
    assert min(coef) >= 0 and coef[2] == 0.0
    with pytest.raises(ValueError):
        fit_quadratic([])


def test_the_profile_file_carries_the_square_term_to_the_cost_model() -> None:
    points = [{"tokens": n, "ttft_s": _curve(n)} for n in LENGTHS]
    doc = profile_document("http://x", "m", points, [{"batch_size": 1, "step_s": 0.004}], 32)
    assert doc["prefill"]["per_token_sq_s"] == pytest.approx(C, rel=1e-6)
    assert InstanceProfile.from_dict(doc).prefill.per_token_sq_s == pytest.approx(C, rel=1e-6)
    costs = PathCosts.from_profile(doc)
    assert costs.prefill_s(2048) == pytest.approx(_curve(2048), rel=1e-6)
    # a profile without the term (every profile written before it) stays linear
    del doc["prefill"]["per_token_sq_s"]
    assert PathCosts.from_profile(doc).prefill_s_per_token_sq == 0.0


def test_tokens_after_a_cached_prefix_cost_more_only_with_the_square_term() -> None:
    bent = PathCosts(prefill_s_per_token=B, prefill_fixed_s=A, prefill_s_per_token_sq=C)
    assert bent.prefill_s(256, context=2048) == pytest.approx(
        A + B * 256 + C * (2304 ** 2 - 2048 ** 2))
    assert bent.prefill_s(256, context=2048) > bent.prefill_s(256)
    straight = PathCosts(prefill_s_per_token=B, prefill_fixed_s=A)  # control
    assert straight.prefill_s(256, context=2048) == straight.prefill_s(256)
    assert bent.prefill_s(0, context=2048) == 0.0


def _prefill_time(costs: PathCosts, uncached: int, context: int, chunk: int) -> float:
    """Seconds one engine takes to prefill a lone prompt, chunk by chunk."""
    engine: ColocatedEngine[str] = ColocatedEngine("e", "aggregated", costs, chunk, 1000)
    engine.add_prefill("r", uncached, context)
    now, done = 0.0, []
    while not done:
        end = engine.wake(now)
        assert end is not None
        now = end
        done, _ = engine.complete(now)
    return now


def test_the_colocated_engine_charges_each_chunk_after_its_context() -> None:
    bent = PathCosts(prefill_s_per_token=B, prefill_fixed_s=A, prefill_s_per_token_sq=C)
    # 3,000 fresh tokens in chunks of 2,048: a fixed cost per chunk, the square term telescopes
    assert _prefill_time(bent, 3000, 0, 2048) == pytest.approx(2 * A + B * 3000 + C * 3000 ** 2)
    # 200 tokens after 2,000 cached attend to them
    assert _prefill_time(bent, 200, 2000, 2048) == pytest.approx(
        A + B * 200 + C * (2200 ** 2 - 2000 ** 2))
    straight = PathCosts(prefill_s_per_token=B, prefill_fixed_s=A)  # control: context is free
    assert _prefill_time(straight, 200, 2000, 2048) == pytest.approx(A + B * 200)


def test_scaling_the_costs_scales_every_prefill_term_and_every_decode_term() -> None:
    bent = PathCosts(prefill_s_per_token=B, prefill_fixed_s=A, prefill_s_per_token_sq=C)
    slow = bent.scaled(1.5, 2.0)
    assert slow.prefill_s(300, context=1500) == pytest.approx(1.5 * bent.prefill_s(300, 1500))
    assert slow.step_s(4) == pytest.approx(2.0 * bent.step_s(4))
    assert (slow.hop_s, slow.pull_s_per_token) == (bent.hop_s, bent.pull_s_per_token)
