"""The clairvoyant autoscaler's parts: level lookup, the steady-state table, lookahead."""

from __future__ import annotations

import pytest

from bench.sim.engine import IntervalStats
from bench.sim.oracle import OracleController, level_at, monotone, pool_for, smallest_pool

STEP = [(0.0, 0.1), (100.0, 0.1), (101.0, 1.0), (300.0, 1.0)]
TABLE = monotone({0.1: (2, 1), 0.5: (4, 2), 1.0: (7, 3)})


def stats(now_s: float) -> IntervalStats:
    return IntervalStats(now_s=now_s, interval_s=10.0, arrivals=0, uncached_tokens=0,
                         output_tokens=0, ttft_s=(), tpot_s=(), prefill_replicas=1,
                         decode_replicas=1, prefill_ready=1, decode_ready=1, prefill_busy=0.0,
                         decode_slots=0.0)


def test_level_interpolates_between_knots_and_holds_past_the_ends() -> None:
    assert level_at(STEP, -5.0) == 0.1
    assert level_at(STEP, 50.0) == 0.1
    assert level_at(STEP, 100.5) == pytest.approx(0.55)
    assert level_at(STEP, 999.0) == 1.0


def test_a_level_between_rows_takes_the_next_higher_row() -> None:
    assert pool_for(TABLE, 0.1) == (2, 1)
    assert pool_for(TABLE, 0.11) == (4, 2)
    assert pool_for(TABLE, 0.5) == (4, 2)
    assert pool_for(TABLE, 1.2) == (7, 3)  # above the table: its top row


def test_table_is_made_non_decreasing() -> None:
    # bisection noise: a higher level measured a smaller decode pool
    table = monotone({0.2: (3, 2), 0.1: (2, 1), 0.4: (5, 1)})
    assert table == {0.1: (2, 1), 0.2: (3, 2), 0.4: (5, 2)}


def test_smallest_pool_bisects_decode_then_prefill() -> None:
    asked: list[tuple[int, int]] = []

    def attains(p: int, d: int) -> bool:
        asked.append((p, d))
        return p >= 3 and d >= 2

    assert smallest_pool(attains, 12, 8) == (3, 2)
    assert all(p == 12 for p, _ in asked[:4])  # decode first, at the prefill maximum
    assert smallest_pool(lambda p, d: False, 12, 8) is None  # even the maximum misses


def test_oracle_asks_for_the_step_a_start_ahead_of_it() -> None:
    oracle = OracleController(STEP, TABLE, lookahead_s=40.0)
    assert oracle.initial() == (2, 1)
    assert oracle.decide(stats(50.0)) == (2, 1)  # the step at 100 s is 50 s away
    assert oracle.decide(stats(70.0)) == (7, 3)  # 30 s away: ask now, serve by then
    assert oracle.decide(stats(300.0)) == (7, 3)
    # negative control: without lookahead the same controller waits for the step itself
    blind = OracleController(STEP, TABLE, lookahead_s=0.0)
    assert blind.decide(stats(70.0)) == (2, 1)
    assert blind.decide(stats(110.0)) == (7, 3)


def test_margin_scales_the_level_it_sizes_for() -> None:
    lean = OracleController(STEP, TABLE, lookahead_s=40.0, margin=0.5)
    assert lean.decide(stats(300.0)) == (4, 2)  # level 1.0 sized as 0.5


def test_a_floor_holds_a_pool_below_it_and_not_above() -> None:
    floored = OracleController(STEP, TABLE, lookahead_s=0.0, floor=0.5)
    assert floored.initial() == (4, 2)  # the quiet start sized as 0.5, not as its level
    assert floored.decide(stats(110.0)) == (7, 3)  # above the floor the level rules
    # control: without the floor the quiet start gets the quiet pool
    assert OracleController(STEP, TABLE, lookahead_s=0.0).initial() == (2, 1)
