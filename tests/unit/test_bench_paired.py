"""Request-by-request comparison of two replays (bench.paired) and its verdict in
bench.routing_real: differences count only beyond chance, and the files it reads are the ones
the replay writes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from bench.client import RequestResult
from bench.paired import (
    FAILED_TTFT_S,
    RequestOutcome,
    compare,
    mcnemar_p,
    paired_percentile_ci,
    read_outcomes,
)
from bench.report import write_requests_csv
from bench.routing_real import paired_verdict, requests_csv

SLO_TTFT_S = 1.0


def _outcomes(ttfts: list[float | None]) -> dict[int, RequestOutcome]:
    return {i: RequestOutcome(met=t is not None and t <= SLO_TTFT_S, ttft_s=t)
            for i, t in enumerate(ttfts)}


def test_mcnemar_exact_two_sided_values() -> None:
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_p(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert mcnemar_p(3, 3) == 1.0  # a tie is no evidence either way


def test_percentile_difference_of_a_shifted_copy_is_the_shift() -> None:
    rng = random.Random(1)
    a = [rng.uniform(0.1, 0.5) for _ in range(200)]
    diff, lo, hi = paired_percentile_ci(a, [x + 0.25 for x in a], 99)
    assert diff == pytest.approx(0.25) and lo == pytest.approx(0.25) and hi == pytest.approx(0.25)
    # control: the same sample twice differs by nothing
    assert paired_percentile_ci(a, a, 99) == (0.0, 0.0, 0.0)


def test_a_few_misses_are_level_and_many_are_behind() -> None:
    base = [0.2] * 300
    few = list(base)
    for i in range(3):  # ours misses three the peer met: what two runs of one router show
        few[i] = 1.5
    c = compare(_outcomes(few), _outcomes(base))
    assert (c.only_ours_met, c.only_peer_met) == (0, 3)
    assert c.behind() == [] and c.ahead() == []
    many = list(base)
    for i in range(0, 300, 20):  # 15 misses, and they are the tail
        many[i] = 1.5
    c = compare(_outcomes(many), _outcomes(base))
    assert c.behind() == ["attainment", "TTFT p99"]
    assert c.ttft_p99_diff_s > 1.0
    # the same comparison the other way round: the peer is the one behind
    assert compare(_outcomes(base), _outcomes(many)).ahead() == ["attainment", "TTFT p99"]


def test_a_failed_request_counts_in_the_tail_not_out_of_it() -> None:
    ours = [0.2] * 100
    peer = list(ours)
    for i in range(5):
        ours[i] = None  # no first token: dropping these would make ours look as good
    c = compare(_outcomes(ours), _outcomes(peer))
    assert c.ttft_p99_diff_s == pytest.approx(FAILED_TTFT_S - 0.2)
    assert c.only_peer_met == 5 and math.isfinite(c.ttft_p99_ci_s[1])


def _write(path: Path, ttfts: list[float | None]) -> None:
    results = []
    for i, t in enumerate(ttfts):
        r = RequestResult(index=i, scheduled_s=0.1 * i, prompt_tokens=10, max_tokens=2,
                          sent_s=0.1 * i, ok=t is not None, status_code=200 if t else 500,
                          token_times_s=[] if t is None else [t, t + 0.01], output_tokens=2)
        results.append(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_requests_csv(path, results, slo_ttft_s=SLO_TTFT_S, slo_tpot_s=0.05)


def test_read_outcomes_reads_what_the_replay_writes(tmp_path: Path) -> None:
    _write(tmp_path / "requests.csv", [0.3, 1.2, None])
    got = read_outcomes(tmp_path / "requests.csv")
    assert got == {0: RequestOutcome(True, 0.3), 1: RequestOutcome(False, 1.2),
                   2: RequestOutcome(False, None)}


@pytest.mark.parametrize("rounds", [1, 2])
def test_paired_verdict_over_a_run_directory(tmp_path: Path, rounds: int) -> None:
    n = 200
    good, bad = [0.2] * n, [1.5 if i % 10 == 0 else 0.2 for i in range(n)]
    points = []
    for round_ in range(rounds):
        for router, ttfts, hit in (("dualmap", good, 0.30), ("aibrix_prefix", good, 0.31),
                                   ("round_robin", bad, 0.20)):
            p = {"trace": "api", "rate": 3.0, "router": router, "hit_rate": hit,
                 "round": round_}
            _write(requests_csv(tmp_path, p, rounds > 1), ttfts)
            points.append(p)
    (tmp_path / "points.json").write_text(json.dumps(points))
    [line] = paired_verdict(points, tmp_path)
    assert line.startswith("api @ 3 req/s: dualmap behind a peer")
    peer_lines = {x.split(":")[0].strip("- ").strip(): x for x in line.splitlines()[1:]}
    # level with aibrix on latency, behind it on the hit rate alone
    assert "behind on hit rate, ahead on nothing" in peer_lines["aibrix_prefix"]
    # ahead of round robin on everything, its misses pooled over the rounds
    assert f"met by one only {20 * rounds} / 0" in peer_lines["round_robin"]
    assert "behind on nothing, ahead on attainment, TTFT p99, hit rate" in \
        peer_lines["round_robin"]
    # control: with aibrix's hit rate no higher than ours, the bar is met
    for p in points:
        if p["router"] == "aibrix_prefix":
            p["hit_rate"] = 0.30
    assert "meets the bar against every peer" in paired_verdict(points, tmp_path)[0]


def test_two_runs_pool_request_by_request(tmp_path: Path) -> None:
    """Two runs of the same trace: each alone shows too few misses to call, together enough
    (the verdict reads each run's records from its own directory)."""
    n = 300
    good = [0.2] * n
    bad = [1.5 if i in range(0, 40, 8) else 0.2 for i in range(n)]  # 5 misses per run
    points = []
    for run in ("a", "b"):
        for router, ttfts in (("dualmap", good), ("round_robin", bad)):
            p = {"trace": "api", "rate": 3.0, "router": router, "hit_rate": 0.3, "round": 0,
                 "run": str(tmp_path / run)}
            _write(requests_csv(tmp_path / run, p, False), ttfts)
            points.append(p)
    alone = paired_verdict([p for p in points if p["run"].endswith("a")], tmp_path)[0]
    assert "met by one only 5 / 0 (p 0.06)" in alone and "ahead on nothing" in alone
    both = paired_verdict(points, tmp_path)[0]
    assert "met by one only 10 / 0 (p 0.00)" in both and "ahead on attainment" in both
