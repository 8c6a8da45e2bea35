"""``pdserve sim`` CLI contract: outputs, names, and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.profile import profile_document
from bench.sim.cli import main
from bench.synth import gamma_rows
from bench.trace import write_trace
from router.autoscale.profile import InstanceProfile

KEYS = {"effective_capacity_rps", "ttft_p50", "ttft_p99", "slo_attainment", "cache_hit_ratio",
        "load_max_over_mean"}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    write_trace(gamma_rows(300, rate_rps=2.0, seed=5), path, layout="v2")
    return path


def test_writes_summary_report_and_plots(trace: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["--trace", str(trace), "--prefill", "4", "--decode", "2",
               "--policies", "dualmap,round_robin", "--slo-ttft", "2", "--slo-tpot", "0.1",
               "--out", str(out), "--seed", "1"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"dualmap", "round_robin"}
    for metrics in summary.values():
        assert set(metrics) >= KEYS
        assert metrics["effective_capacity_rps"] > 0
        assert 0 <= metrics["cache_hit_ratio"] <= 1
    report = (out / "report.md").read_text()
    assert "| dualmap |" in report and "| round_robin |" in report
    for png in ("attainment.png", "ttft_cdf.png", "load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the results on the terminal too, not only in the files
    printed = capsys.readouterr().out
    assert "| dualmap |" in printed and "| round_robin |" in printed
    assert printed.rstrip().endswith(f"wrote {out / 'report.md'} (summary.json and plots "
                                      "beside it)")


@pytest.mark.parametrize(("args", "message"), [
    (["--policies", "dualmap,magic"], "unknown policy magic"),
    (["--trace", "/nonexistent.csv"], "cannot read trace"),
    (["--prefill", "0"], "--prefill"),
])
def test_bad_input_exits_2(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           args: list[str], message: str) -> None:
    base = {"--trace": str(trace), "--prefill": "2", "--decode": "1", "--policies": "dualmap",
            "--slo-ttft": "2", "--slo-tpot": "0.1", "--out": str(tmp_path / "o")}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert main([x for kv in base.items() for x in kv]) == 2
    assert message in capsys.readouterr().err


def test_calibration_reads_what_bench_profile_writes(trace: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--calibration`` takes ``pdserve bench profile``'s document: instances 4x slower than
    the default sustain a lower rate; a bad profile exits 2 naming the key."""
    default = InstanceProfile()
    slow = default.scaled(4.0)
    doc = profile_document(
        "http://w", "m",
        [{"tokens": n, "ttft_s": slow.prefill.overhead_s + slow.prefill.per_token_s * n}
         for n in (64, 512)],
        [{"batch_size": b, "step_s": slow.decode.step_s + slow.decode.per_seq_s * b}
         for b in (1, 8)], 32)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    caps = {}
    for name, extra in (("default", []), ("slow", ["--calibration", str(tmp_path / "p.json")])):
        out = tmp_path / name
        assert main(["--trace", str(trace), "--prefill", "2", "--decode", "2", "--policies",
                     "round_robin", "--ttft-slo-s", "2", "--out", str(out), *extra]) == 0
        caps[name] = json.loads((out / "summary.json").read_text())["round_robin"][
            "effective_capacity_rps"]
    assert caps["slow"] < 0.5 * caps["default"], caps
    (tmp_path / "bad.json").write_text('{"prefill": {"tokens_per_s": 1}}')
    assert main(["--trace", str(trace), "--prefill", "2", "--decode", "1", "--policies",
                 "dualmap", "--calibration", str(tmp_path / "bad.json"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "unknown prefill keys ['tokens_per_s']" in capsys.readouterr().err


V1_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


@pytest.mark.parametrize(("text", "message"), [
    ("time,tokens\n1,2\n", "header lacks column(s)"),
    (V1_HEADER + "x,ChatGPT,1,1,2,API log\n", "bad.csv:2: column 'Timestamp'"),
    (V1_HEADER + "1,ChatGPT,5,0,5,API log\n", "has only 0 usable rows"),  # failed rows only
])
def test_malformed_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                 message: str) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    rc = main(["--trace", str(bad), "--prefill", "2", "--decode", "1", "--policies", "dualmap",
               "--slo-ttft", "2", "--slo-tpot", "0.1", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["planner", "threshold", "static"])
def test_autoscale_summary_and_replicas_plot(trace: Path, tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    rc = main(["--trace", str(trace), "--prefill", "3", "--decode", "2",
               "--policies", "dualmap,round_robin", "--slo-ttft", "2", "--slo-tpot", "0.1",
               "--out", str(out), "--autoscale", mode, "--autoscale-interval-s", "5",
               "--start-delay-s", "10"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"dualmap", "round_robin"}
    for m in summary.values():
        assert m["autoscale"] == mode
        inst = m["instance_seconds"]
        assert inst["total"] == pytest.approx(inst["prefill"] + inst["decode"])
        assert 0 < inst["total"] <= 5 * m["sim_end_s"] + 1e-6
        assert 0 <= m["slo_attainment"] <= min(m["slo_attainment_ttft"],
                                               m["slo_attainment_tpot"])
        assert 1 <= m["replicas_max"]["prefill"] <= 3 and 1 <= m["replicas_max"]["decode"] <= 2
        if mode == "static":
            assert m["replicas_max"] == {"prefill": 3, "decode": 2}
            assert inst["prefill"] == pytest.approx(3 * m["sim_end_s"])
    assert (out / "replicas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"| dualmap | {mode} |" in (out / "report.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--autoscale", "magic"], "unknown autoscaler 'magic'"),
    (["--autoscale", "planner", "--min", "3"], "--min"),
])
def test_bad_autoscale_exits_2(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               args: list[str], message: str) -> None:
    rc = main(["--trace", str(trace), "--prefill", "2", "--decode", "1", "--policies", "dualmap",
               "--slo-ttft", "2", "--slo-tpot", "0.1", "--out", str(tmp_path / "o"), *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_pdserve_sim_paths_prints_each_capacity_as_found(tmp_path: Path) -> None:
    # through the `pdserve` entry point, which hands `sim` to its plugin before configuring
    # logging: the plugin must configure it, or a run of many minutes prints nothing until the end
    proc = subprocess.run(
        [sys.executable, "-m", "serve.cli", "sim", "paths", "--instances", "2", "--seeds", "0",
         "--workloads", "prefill_heavy", "--fleets", "aggregated", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stderr.splitlines()
                if line.startswith("prefill_heavy seed 0 aggregated: ")]
    assert len(progress) == 1, proc.stderr
    # control: the table at the end goes to stdout, not counted as progress
    assert "prefill_heavy" in proc.stdout and (tmp_path / "paths.json").exists()
