"""The event-loop lag probe (router.loop_lag)."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.loop_lag import LoopLagProbe
from router.metrics import RouterMetrics


async def test_a_held_loop_shows_as_lag_of_at_least_the_hold() -> None:
    """A callback that holds the loop 0.3 s delays the probe's wake-up by at least the hold
    less one interval (the probe's sleep may have begun up to one interval before)."""
    lags: list[float] = []
    probe = LoopLagProbe(lags.append, interval_s=0.05)
    probe.start()
    await asyncio.sleep(0.12)  # a few probes run first
    seen_before = len(lags)
    time.sleep(0.3)  # holds the loop, as a synchronous parse would
    while len(lags) <= seen_before:
        await asyncio.sleep(0.01)
    await probe.close()
    assert seen_before >= 1
    assert lags[seen_before] >= 0.3 - 0.05
    assert all(lag >= 0.0 for lag in lags)


async def test_lag_is_the_time_past_due() -> None:
    """On a clock the test moves: a sleep that ends on time is no lag (control), one that ends
    20 ms late is 20 ms, one that (by clock resolution) ends early is none."""
    now = [100.0]
    over = iter([0.0, 0.02, -0.001])

    async def sleep(seconds: float) -> None:
        now[0] += seconds + next(over)

    seen: list[float] = []
    probe = LoopLagProbe(seen.append, interval_s=0.05, clock=lambda: now[0], sleep=sleep)
    assert [await probe.probe() for _ in range(3)] == pytest.approx([0.0, 0.02, 0.0])
    assert seen == pytest.approx([0.0, 0.02, 0.0])


def test_the_router_exports_it() -> None:
    metrics = RouterMetrics()
    probe = LoopLagProbe(metrics.loop_lag.observe)
    probe._observe(0.012)
    assert metrics.registry.get_sample_value(
        "pdserve_router_event_loop_lag_seconds_count") == 1.0
    assert metrics.registry.get_sample_value(
        "pdserve_router_event_loop_lag_seconds_bucket", {"le": "0.01"}) == 0.0
    assert metrics.registry.get_sample_value(
        "pdserve_router_event_loop_lag_seconds_bucket", {"le": "0.025"}) == 1.0


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagProbe(lambda lag: None, interval_s=0)
