"""The goodput benchmark's workloads in the simulator: the same requests a real rate point
replays (times, lengths, shared prefixes), and the ranking agreement against a measured table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.goodput_workloads import WORKLOADS, _synth, point_rows
from bench.sim.bench_workloads import BenchWorkload, bench_workloads
from bench.sim.cli import main as sim_main
from bench.sim.paths import Row
from bench.sim.report import ranking_agreement, real_capacities


@pytest.mark.parametrize("name", ["mix", "multi_turn"])
def test_the_in_process_trace_is_what_pdserve_bench_synth_writes(tmp_path: Path,
                                                                  name: str) -> None:
    workload = WORKLOADS[name]
    _synth(workload, tmp_path / "here.csv", 40.0, seed=4)
    subprocess.run([sys.executable, "-m", "serve.cli", "bench", "synth", "--out",
                    str(tmp_path / "cli.csv"), "--duration", "40", "--rate", "1",
                    "--prompt-median", str(workload.prompt_median),
                    "--response-median", str(workload.response_median),
                    "--max-prompt-tokens", str(workload.max_prompt_tokens),
                    "--max-response-tokens", str(workload.max_response_tokens),
                    "--conversation-fraction", str(workload.conversation_fraction),
                    "--seed", "4", "--layout", "v2" if workload.sessions else "v1"],
                   check=True, stdout=subprocess.DEVNULL)
    assert (tmp_path / "here.csv").read_text() == (tmp_path / "cli.csv").read_text()


def test_a_simulated_point_replays_the_real_points_requests() -> None:
    sim = bench_workloads(point_s=30.0)["bench:switching"]
    assert (sim.ttft_slo_s, sim.tpot_slo_s) == (2.0, 0.025)
    assert sim.duration_s == 60.0  # switching's minimum point
    real = point_rows(WORKLOADS["switching"], 3.0, 60.0, seed=2)
    requests = sim.requests(3.0, seed=2)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == \
        [(t, row.request_tokens, row.response_tokens) for t, row in real]
    # scheduled as the replay schedules it: 3 req/s from 0 over about the point's span
    assert requests[0].arrival_s == 0.0
    assert (len(requests) - 1) / requests[-1].arrival_s == pytest.approx(3.0)
    # single-shot prompts share nothing
    assert all(r.block_hashes == () for r in requests)


def test_multi_turn_turns_start_with_their_sessions_history() -> None:
    requests = BenchWorkload(WORKLOADS["multi_turn"], point_s=120.0).requests(2.0, seed=1)
    rows = [row for _, row in point_rows(WORKLOADS["multi_turn"], 2.0, 120.0, seed=1)]
    last: dict[str, tuple[int, tuple[int, ...]]] = {}
    continued = 0
    for req, row in zip(requests, rows, strict=True):
        assert len(req.block_hashes) == req.prompt_tokens // 16
        if row.session_id in last:
            history, blocks = last[row.session_id]
            if history < req.prompt_tokens:  # the replay resends the history
                continued += 1
                assert req.block_hashes[:len(blocks)] == blocks
        if row.session_id and row.log_type.startswith("Conv"):
            last[row.session_id] = (req.prompt_tokens + req.output_tokens, req.block_hashes)
    assert continued >= 5
    # negative control: prompts of different sessions share no block
    starts: dict[str, set[int]] = {}
    for req, row in zip(requests, rows, strict=True):
        if req.block_hashes:
            starts.setdefault(row.session_id or f"api-{req.index}", set()).add(
                req.block_hashes[0])
    sets = list(starts.values())
    assert len(sets) > 5
    assert all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1:])


def _row(name: str, **caps: float) -> Row:
    return Row(name, {f: [c] for f, c in caps.items()}, [])


def test_ranking_agreement_counts_pairs_ordered_alike() -> None:
    real = real_capacities({"mix": {
        "aggregated": [{"max_rate_rps": 2.0}, {"max_rate_rps": 3.0}],  # the lower counts
        "pd": [{"max_rate_rps": 1.0}], "adaptive": [{"max_rate_rps": None}],
        "plain": [{"max_rate_rps": 4.0}]}})
    assert real == {"mix": {"aggregated": 2.0, "pd": 1.0, "adaptive": 0.0, "plain": 4.0}}
    alike = ranking_agreement([_row("bench:mix", aggregated=9.0, **{"pd1:1": 5.0},
                                    adaptive=1.0)], real)
    assert "| mix |" in alike and "3 of 3" in alike and "aggregated; aggregated" in alike
    # negative control: the reversed order agrees on no pair
    reversed_ = ranking_agreement([_row("bench:mix", aggregated=1.0, **{"pd1:1": 5.0},
                                        adaptive=9.0)], real)
    assert "0 of 3" in reversed_
    # a tie in the real table matches simulated capacities within 5 %, not further apart
    tied = {"mix": {"aggregated": 2.0, "pd": 2.0}}
    assert "1 of 1" in ranking_agreement([_row("bench:mix", aggregated=10.0,
                                                **{"pd1:1": 9.7})], tied)
    assert "0 of 1" in ranking_agreement([_row("bench:mix", aggregated=10.0,
                                                **{"pd1:1": 8.0})], tied)
    # the simulator's own workloads are not the measured ones
    assert ranking_agreement([_row("mix", aggregated=1.0, adaptive=2.0)], real) == ""


def test_paths_cli_runs_a_bench_workload_against_a_measured_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    measured = tmp_path / "goodput.json"
    measured.write_text(json.dumps({"decode_heavy": {
        "aggregated": [{"max_rate_rps": 2.0}], "pd": [{"max_rate_rps": 1.0}]}}))
    assert sim_main(["paths", "--instances", "2", "--seeds", "0", "--point-s", "20",
                     "--workloads", "bench:decode_heavy", "--fleets", "aggregated,pd1:1",
                     "--real", str(measured), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| bench:decode_heavy |" in out
    assert "against the measured table" in out and "| decode_heavy | aggregated 2.00 /" in out
    doc = json.loads((tmp_path / "out" / "paths.json").read_text())
    assert doc["slos"] == {"bench:decode_heavy": [1.0, 0.025]}
    assert sim_main(["paths", "--workloads", "bench:nope"]) == 2
    assert sim_main(["paths", "--real", str(tmp_path / "missing.json")]) == 2
