"""Rate sweep: ascending probe, then bisection between the last pass and the first fail."""

from __future__ import annotations

import pytest

from bench.sweep import sweep


def capacity(limit: float):  # type: ignore[no-untyped-def]
    tried: list[float] = []

    async def run(rate: float) -> dict[str, float]:
        tried.append(rate)
        return {"slo_attainment": 1.0 if rate <= limit else 0.5}

    return run, tried


async def test_bisects_to_the_capacity() -> None:
    run, tried = capacity(5.0)
    res = await sweep(run, [8, 1, 2, 4, 16], target=0.9, bisect_steps=3, rel_tol=0.0)
    assert tried == [1, 2, 4, 8, 6.0, 5.0, 5.5]  # stops probing after the first failure
    assert res.max_rate == 5.0
    assert res.passed(5.0) and not res.passed(5.5)


async def test_no_rate_passes_or_all_pass() -> None:
    run, _ = capacity(0.5)
    assert (await sweep(run, [1, 2])).max_rate is None
    run, tried = capacity(100)
    res = await sweep(run, [1, 2])
    assert res.max_rate == 2 and tried == [1, 2]


async def test_rejects_bad_arguments() -> None:
    run, _ = capacity(1)
    with pytest.raises(ValueError):
        await sweep(run, [])
    with pytest.raises(ValueError):
        await sweep(run, [1], target=0)
