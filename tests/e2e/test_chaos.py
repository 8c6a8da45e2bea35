"""`pdserve chaos` in short form: every fault kind once against a real 1P+1D cluster.

One run of the real CLI (its own cluster: vLLM workers, Redis, UCX, the router) feeds a test
per fault kind; each asserts the fault was injected and the cluster became whole again, and the
run as a whole lost, hung, corrupted and stranded nothing while it checked real outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from serve.chaos.faults import KINDS
from serve.chaos.runner import stranded_workers
from tests.support.cluster import SERVED_NAME, Cluster, Plain

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory, plain: Plain
          ) -> tuple[int, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("chaos")
    proc = subprocess.run(
        [sys.executable, "-m", "serve.cli", "chaos", "--faults", str(len(KINDS)),
         "--prefill", "1", "--decode", "1", "--rate", "1", "--lease-s", "6",
         "--redis-outage-s", "4", "--gap-s", "1", "--seed", "7", "--out", str(out),
         # the session's plain server gives the reference outputs (no second one started)
         "--reference-url", plain.url],
        capture_output=True, text=True, timeout=1500)
    summary_path = out / "summary.json"
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.returncode, json.loads(summary_path.read_text()), proc.stderr


def test_nothing_lost_hung_wrong_or_stranded(chaos: tuple[int, dict[str, Any], str]) -> None:
    code, summary, log = chaos
    assert summary["lost"] == 0 and summary["hung"] == 0, summary["requests"]
    assert summary["wrong"] == 0
    assert summary["stranded_kv"] == 0, summary["stranded_workers"]
    assert summary["unrecovered_faults"] == 0
    assert code == 0, log[-3000:]
    # Not vacuous: outputs were compared, and every fault cost the cluster a process it rebuilt.
    assert summary["checked_outputs"] >= 5
    assert summary["requests"]["sent"] == sum(
        summary["requests"][k] for k in ("completed", "failed_clean", "aborted", "lost", "hung"))
    assert summary["restarts"].get("router") == 1
    assert summary["restarts"].get("prefill", 0) >= 2  # killed once, restarted once
    assert summary["restarts"].get("decode", 0) >= 2  # killed once, SIGTERMed once


@pytest.mark.parametrize("kind", KINDS)
def test_fault_kind_injected_and_recovered(chaos: tuple[int, dict[str, Any], str],
                                           kind: str) -> None:
    _, summary, log = chaos
    assert summary["faults_by_kind"].get(kind) == 1, summary["faults_by_kind"]
    assert kind in summary["recovery_s_by_kind"], log[-3000:]
    assert f"fault {kind} injected" in log


def test_client_faults_really_misbehaved(chaos: tuple[int, dict[str, Any], str]) -> None:
    """Each client fault sent its 4 misbehaving clients, and hang-ups really happened (some
    may have been refused first while a pool was down)."""
    _, summary, _ = chaos
    by = summary["requests_by_behaviour"]
    for behaviour in ("abort_mid", "abort_early", "slow"):
        assert sum(by.get(behaviour, {}).values()) == 4, by
    assert by["abort_mid"].get("aborted", 0) + by["abort_early"].get("aborted", 0) >= 2, by


def test_stranded_check_sees_a_held_lease(cluster: Cluster, workers: dict[str, str]) -> None:
    """Negative control of the stranded-KV check: a leased, never pulled prefill is reported
    while the lease holds, and not once it expired."""
    resp = httpx.post(f"{workers['prefill']}/v1/completions", timeout=60,
                      headers=cluster.worker_auth, json={
        "model": SERVED_NAME, "prompt": "stranded " * 200, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": cluster.sign({"do_remote_decode": True}, workers["prefill"])})
    assert resp.json()["kv_transfer_params"]["remote_block_ids"]
    import asyncio

    held = asyncio.run(stranded_workers(cluster.redis_url, 0.0))
    assert any(w.startswith("prefill") for w in held), held
    started = time.monotonic()
    assert asyncio.run(stranded_workers(cluster.redis_url, 60.0)) == {}
    assert time.monotonic() - started > 1.0  # it had to wait for the lease to run out


def test_the_client_view_is_counted_per_fault(chaos: tuple[int, dict[str, Any], str]) -> None:
    """The summary says what the clients saw (failures among requests they did not abort,
    per fault kind) and what the router did (moves, fallbacks), consistently with the
    per-request outcomes."""
    _, summary, _ = chaos
    client, requests = summary["client"], summary["requests"]
    assert client["judged"] == requests["sent"] - requests["aborted"]
    assert client["failures"] <= requests["failed_clean"] + requests["lost"] + requests["hung"]
    by_fault = client["by_fault"]
    assert set(by_fault) <= {*KINDS, "before_faults"}
    assert sum(v["requests"] for v in by_fault.values()) == client["judged"]
    assert sum(v["failures"] for v in by_fault.values()) == client["failures"]
    assert set(summary["router"]) == {"moves", "moves_refused", "fallbacks"}
