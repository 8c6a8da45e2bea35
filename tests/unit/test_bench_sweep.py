"""Rate sweep: ascending probe, then bisection between the last pass and the first fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.sweep import RateSearch, lockstep, sweep


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


def _verdicts(limit: float) -> Callable[[float], bool]:
    return lambda rate: rate <= limit


def test_a_search_one_verdict_at_a_time_tries_what_the_sweep_tries() -> None:
    search, tried = RateSearch([8, 1, 2, 4, 16], bisect_steps=3, rel_tol=0.0), []
    passes = _verdicts(5.0)
    while (rate := search.next_rate()) is not None:
        tried.append(rate)
        search.record(rate, passes(rate))
    assert tried == [1, 2, 4, 8, 6.0, 5.0, 5.5] and search.lo == 5.0 and search.hi == 5.5
    # control: a tolerance as wide as the bracket ends it before any bisection
    search = RateSearch([4, 8], bisect_steps=3, rel_tol=0.5)
    for rate in (4, 8):
        assert search.next_rate() == rate
        search.record(rate, rate <= 5.0)
    assert search.next_rate() is None and search.lo == 4


def test_lockstep_gives_each_search_its_own_points_in_rotated_turns() -> None:
    limits = {"a": 5.0, "b": 100.0, "c": 3.0}
    searches = {name: RateSearch([2, 4, 8], bisect_steps=2, rel_tol=0.0) for name in limits}
    order: list[tuple[int, str, float]] = []

    def run(name: str, rate: float, step: int) -> bool:
        order.append((step, name, rate))
        return rate <= limits[name]

    lockstep(searches, run)
    # the same points as each search alone, and the same verdicts
    for name, limit in limits.items():
        alone = RateSearch([2, 4, 8], bisect_steps=2, rel_tol=0.0)
        expected = []
        while (rate := alone.next_rate()) is not None:
            expected.append(rate)
            alone.record(rate, rate <= limit)
        assert [r for _, n, r in order if n == name] == expected
        assert searches[name].lo == alone.lo
    assert (searches["a"].lo, searches["b"].lo, searches["c"].lo) == (5.0, 8, 3.0)
    # each step runs every live search once, the order rotated by one per step (control:
    # without the rotation every step would start with "a")
    by_step = [[n for s, n, _ in order if s == step] for step in range(5)]
    assert by_step == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["c", "a"], ["a"]]
