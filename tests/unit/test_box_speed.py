"""``bench.box_speed``: what its three numbers are, computed from the clock it is given."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest

from bench.box_speed import LOOP_N, BoxSpeed, measure, wake_round_trip_us


def _clock(step_s: float) -> Callable[[], float]:
    """A clock that advances ``step_s`` at every reading: each timed span lasts ``step_s``."""
    now = [0.0]

    def read() -> float:
        now[0] += step_s
        return now[0]
    return read


@pytest.mark.parametrize("step_s", [0.01, 0.02])
def test_the_numbers_are_bytes_and_loops_per_second_of_the_timed_spans(step_s: float) -> None:
    """A 1 MiB copy (read and written: 2 MiB moved), LOOP_N iterations and a wake round trip,
    each timed as ``step_s``. The two steps are each other's control: twice the time, half the
    speed."""
    got = measure(timer=_clock(step_s), copy_mib=1, repeats=3)
    assert got.copy_gbps == pytest.approx(2 * 2**20 / step_s / 1e9)
    assert got.loop_mops == pytest.approx(LOOP_N / step_s / 1e6)
    two_cores = len(os.sched_getaffinity(0)) >= 2
    assert got.wake_us == (pytest.approx(step_s * 1e6) if two_cores else 0.0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_wake_round_trip_crosses_cores_and_needs_two() -> None:
    """Across two cores the round trip is a real one; confined to one core there is no other
    core to wake (0), and the caller's cores are given back either way."""
    cores = os.sched_getaffinity(0)
    assert wake_round_trip_us(trips=200) > 0
    assert os.sched_getaffinity(0) == cores
    os.sched_setaffinity(0, {min(cores)})
    try:
        assert wake_round_trip_us(trips=200) == 0.0
    finally:
        os.sched_setaffinity(0, cores)


def test_a_real_reading_is_positive_and_printable() -> None:
    got = measure(copy_mib=1, repeats=1)
    assert got.copy_gbps > 0 and math.isfinite(got.copy_gbps)
    assert got.loop_mops > 0 and math.isfinite(got.loop_mops)
    assert BoxSpeed(**got.as_dict()).line().startswith("copy ")
    assert BoxSpeed(5.06, 31.24, 84.4).line() == "copy 5.1 GB/s, loop 31.2 M/s, wake 84 us"
