"""bench.pd_variants: variant specs, the rotated order, and the pooled request-by-request report."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench.paired import read_outcomes
from bench.pd_variants import Variant, parse_variants, plan_line, report, round_order, run_dir


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


def _write(out: Path, name: str, round_: int, misses: set[int], tpot_s: float) -> None:
    path = run_dir(out, name, round_) / "point" / "requests.csv"
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
