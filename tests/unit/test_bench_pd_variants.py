"""bench.pd_variants: variant specs, the rotated order, and the pooled request-by-request report."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from bench.paired import read_outcomes
from bench.pd_variants import (
    Variant,
    ladder_lines,
    ladder_order,
    parse_variants,
    plan_line,
    ratio_bounds,
    report,
    round_order,
    run_dir,
    sustained,
)


def test_variants_parse_with_their_arguments_in_order() -> None:
    got = parse_variants(["static=aggregated", "held=aggregated"],
                         ["held=--router-arg=--path-policy=adaptive",
                          "held=--router-arg=--no-hold-prefills"])
    assert got == [Variant("static", "aggregated", ()),
                   Variant("held", "aggregated", ("--router-arg=--path-policy=adaptive",
                                                  "--router-arg=--no-hold-prefills"))]


@pytest.mark.parametrize(("specs", "args", "message"), [
    (["static", "b=aggregated"], [], "NAME=SETUP"),
    (["a=nosuch", "b=aggregated"], [], "unknown setup"),
    (["a=aggregated", "a=adaptive"], [], "twice"),
    (["a=aggregated", "b=adaptive"], ["c=--x"], "for a --variant NAME"),
    (["a=aggregated"], [], "at least two"),
])
def test_bad_variant_specs_are_refused(specs: list[str], args: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_variants(specs, args)


def test_each_variant_runs_in_every_position_over_as_many_rounds() -> None:
    vs = [Variant(n, "aggregated") for n in "abc"]
    orders = [[v.name for v in round_order(vs, r)] for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for position in range(3):
        assert {o[position] for o in orders} == {"a", "b", "c"}


def _write(out: Path, name: str, round_: int, misses: set[int], tpot_s: float,
           rate: float | None = None) -> None:
    path = run_dir(out, name, round_, rate) / "point" / "requests.csv"
    path.parent.mkdir(parents=True)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["index", "ok", "meets_slo", "ttft_s", "tpot_s"])
        for i in range(40):
            w.writerow([i, 1, 0 if i in misses else 1, 0.05 + 0.001 * i, tpot_s])


def test_report_pools_the_rounds_request_by_request(tmp_path: Path) -> None:
    # b misses 4 requests a meets in each round: too few to call in one round (p 0.125),
    # beyond chance when the two rounds are pooled (8 to 0, p 0.0078)
    for r in range(2):
        _write(tmp_path, "a", r, set(), 0.010)
        _write(tmp_path, "b", r, {1, 2, 3, 4}, 0.012)
    lines = report(tmp_path, ["a", "b"], 2)
    assert "b round 1: attainment 0.900 (4 of 40 missed)" in lines
    per_round = [ln for ln in lines if ln.startswith("round ")]
    assert len(per_round) == 2 and all("a only met 4 / b only met 0 (p 0.125)" in ln
                                       for ln in per_round)
    pooled = [ln for ln in lines if ln.startswith("pooled: ")]
    assert len(pooled) == 1
    assert "a only met 8 / b only met 0 (p 0.00781)" in pooled[0]
    assert "TPOT median paired diff -2.00 ms, a slower on 0/80" in pooled[0]


def test_report_of_identical_runs_finds_no_difference(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _write(tmp_path, name, 0, {5}, 0.010)
    pooled = [ln for ln in report(tmp_path, ["a", "b"], 1) if ln.startswith("pooled: ")]
    assert "a only met 0 / b only met 0 (p 1)" in pooled[0]
    assert "TTFT p99 diff +0 ms [+0, +0]" in pooled[0]


def test_report_leaves_out_runs_without_records(tmp_path: Path) -> None:
    _write(tmp_path, "a", 0, set(), 0.010)
    lines = report(tmp_path, ["a", "b"], 2)
    assert lines == ["a round 0: attainment 1.000 (0 of 40 missed)"]


def test_a_variant_may_run_from_another_source_tree(tmp_path: Path) -> None:
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "cli.py").write_text("")
    got = parse_variants(["before=aggregated", "after=aggregated"], [],
                         [f"before={tmp_path}"])
    assert got == [Variant("before", "aggregated", (), str(tmp_path.resolve())),
                   Variant("after", "aggregated")]
    # control: a directory without pdserve's sources, a tree for no variant, or two for one
    with pytest.raises(ValueError, match="no pdserve sources"):
        parse_variants(["a=aggregated", "b=aggregated"], [], [f"a={tmp_path / 'serve'}"])
    with pytest.raises(ValueError, match="for a --variant NAME"):
        parse_variants(["a=aggregated", "b=aggregated"], [], [f"c={tmp_path}"])
    with pytest.raises(ValueError, match="once"):
        parse_variants(["a=aggregated", "b=aggregated"], [], [f"a={tmp_path}"] * 2)


def _timeline(point: Path, plans: dict[int, dict[str, float]]) -> None:
    with (point / "timeline.jsonl").open("w") as fh:
        for i, plan in plans.items():
            fh.write(json.dumps({"request_id": f"bench-{i}", "plan": plan}) + "\n")
        fh.write(json.dumps({"request_id": "warm-1", "plan": {"hold_s": 1.0}}) + "\n")


def test_plan_line_joins_the_router_timeline_with_the_client_records(tmp_path: Path) -> None:
    _write(tmp_path, "a", 0, {1, 2}, 0.010)  # every request observed at 10 ms per token
    point = run_dir(tmp_path, "a", 0) / "point"
    # requests 0-9 held (1 and 2 missed); predicted TPOTs 5 ms for 0-19 and 20 ms for the rest
    _timeline(point, {i: {"hold_s": 0.3 if i < 10 else 0.0,
                          "predicted_tpot_s": 0.005 if i < 20 else 0.020} for i in range(40)})
    csv_path = point / "requests.csv"
    outcomes, tpots = read_outcomes(csv_path), {i: 0.010 for i in range(40)}
    line = plan_line(point, outcomes, tpots)
    assert line.startswith("held 10 of 40 (met 8); TPOT observed / predicted p10 0.50, ")
    assert line.endswith(", p90 2.00")
    assert any(ln.endswith(f"; {line}") for ln in report(tmp_path, ["a"], 1))
    # controls: without a timeline (a setup without the router), or with no request of the
    # point in it, there is nothing to say
    (point / "timeline.jsonl").unlink()
    assert plan_line(point, outcomes, tpots) == ""
    _timeline(point, {})
    assert plan_line(point, outcomes, tpots) == ""


def test_a_ladder_runs_every_variant_at_every_rate_in_each_place() -> None:
    vs = [Variant(n, "aggregated") for n in "ab"]
    runs = [[(rate, v.name) for rate, v in ladder_order(vs, [3.0, 2.5], r)] for r in range(2)]
    assert runs == [[(2.5, "a"), (2.5, "b"), (3.0, "b"), (3.0, "a")],
                    [(2.5, "b"), (2.5, "a"), (3.0, "a"), (3.0, "b")]]
    for rate in (2.5, 3.0):  # over the rounds each variant goes first once at each rate
        firsts = {[n for q, n in run if q == rate][0] for run in runs}
        assert firsts == {"a", "b"}


def test_sustained_is_the_top_of_an_unbroken_climb() -> None:
    assert sustained({2.0: 0.95, 2.5: 0.91, 3.0: 0.7}) == 2.5
    # a pass above a failure does not count: the climb ends at the first failure
    assert sustained({2.0: 0.95, 2.5: 0.85, 3.0: 0.93}) == 2.0
    assert sustained({2.0: 0.89, 2.5: 0.95}) is None
    assert sustained({2.0: 0.95, 2.5: None, 3.0: 0.95}) == 2.0


def test_ladder_pools_the_rounds_and_compares_the_variants(tmp_path: Path) -> None:
    # 40 requests a point. a: passes 2 and 3 in both rounds. b: passes 2; at 3 it reads 0.925
    # in round 0 and 0.850 in round 1, 0.8875 pooled: it fails 3 pooled though one round passed
    for r in range(2):
        for rate in (2.0, 3.0):
            _write(tmp_path, "a", r, {1}, 0.01, rate)
        _write(tmp_path, "b", r, set(), 0.01, 2.0)
        _write(tmp_path, "b", r, set(range(3)) if r == 0 else set(range(6)), 0.01, 3.0)
    lines = ladder_lines(tmp_path, ["a", "b"], 2, [3.0, 2.0])
    assert lines == [
        "ladder a: 2: 0.975, 3: 0.975 -> sustains >= 3 (the top) pooled; per round "
        ">= 3 (the top); >= 3 (the top)",
        "ladder b: 2: 1.000, 3: 0.887 -> sustains 2 (fails 3) pooled; per round "
        ">= 3 (the top); 2 (fails 3)",
        "ladder a / best other (b): 1.50x by rungs; capacities' ratio > 1.00x",
        "ladder b / best other (a): 0.67x by rungs; capacities' ratio < 1.00x",
    ]
    # both passing the top rate: nothing is known of their ratio
    top = ladder_lines(tmp_path, ["a", "b"], 2, [2.0])
    assert top[2:] == ["ladder a / best other (b): no ratio (both pass the top rate)",
                       "ladder b / best other (a): no ratio (both pass the top rate)"]
    # b failing the lowest rate leaves only the direction of the ratio to state
    _write(tmp_path / "low", "a", 0, set(), 0.01, 2.0)
    _write(tmp_path / "low", "b", 0, set(range(10)), 0.01, 2.0)
    low = ladder_lines(tmp_path / "low", ["a", "b"], 1, [2.0])
    assert low[1].endswith("sustains < 2 (the lowest fails) pooled; per round < 2 (the lowest "
                           "fails)")
    assert low[2:] == ["ladder a / best other (b): > 1x (only this side sustains the lowest rate)"
                       "; capacities' ratio > 1.00x",
                       "ladder b / best other (a): < 1x (this side fails the lowest rate)"
                       "; capacities' ratio < 1.00x"]
    # control: both failing it, no ratio at all
    _write(tmp_path / "none", "a", 0, set(range(10)), 0.01, 2.0)
    _write(tmp_path / "none", "b", 0, set(range(10)), 0.01, 2.0)
    none = ladder_lines(tmp_path / "none", ["a", "b"], 1, [2.0])
    assert none[2] == "ladder a / best other (b): no ratio (both fail the lowest rate)"


def test_a_ratio_of_rungs_is_bounded_by_the_rungs_around_each_capacity() -> None:
    # one side passes the top (4), the other sustains 3.45 and fails 4: its capacity may be
    # just under 4, so the ratio is only known to exceed 1, not to be 4 / 3.45 = 1.16
    assert ratio_bounds([3.45, 4.0], 4.0, 3.45) == (1.0, math.inf)
    # both sustain 2.75 and fail 3.25: level by rungs, anywhere in 2.75/3.25 ... 3.25/2.75
    low, high = ratio_bounds([2.75, 3.25, 3.75], 2.75, 2.75)
    assert (round(low, 3), round(high, 3)) == (0.846, 1.182)
    # a side failing the lowest rate: only an upper bound on it over the other
    assert ratio_bounds([2.0, 3.0], None, 3.0) == (0.0, 2.0 / 3.0)
    # control: both past the top, nothing is known
    assert ratio_bounds([2.0], 2.0, 2.0) == (0.0, math.inf)


def test_failed_requests_in_the_tail_are_named_not_printed_as_a_difference(
        tmp_path: Path) -> None:
    _write(tmp_path, "a", 0, set(), 0.010)
    _write(tmp_path, "b", 0, set(), 0.010)
    path = run_dir(tmp_path, "b", 0) / "point" / "requests.csv"
    rows = path.read_text().splitlines()
    # b's last request failed: no first token, no TPOT (the bench records an error so)
    rows[-1] = "39,0,0,,"
    path.write_text("\n".join(rows) + "\n")
    pooled = [ln for ln in report(tmp_path, ["a", "b"], 1) if ln.startswith("pooled: ")]
    assert "TTFT p99 diff: failed requests reach the tail (a 0 failed, b 1)" in pooled[0]
    # control: with no failure the difference is printed in milliseconds
    _write(tmp_path / "ok", "a", 0, set(), 0.010)
    _write(tmp_path / "ok", "b", 0, set(), 0.010)
    pooled = [ln for ln in report(tmp_path / "ok", ["a", "b"], 1) if ln.startswith("pooled: ")]
    assert "TTFT p99 diff +0 ms [+0, +0]" in pooled[0]
