"""Placement reads the workers' own load: the real router under uvicorn polls each worker's
``/metrics`` (fake workers report vLLM's gauges, so the load is exactly what the test says).

Load other routers put on a worker is invisible to this router's in-flight accounting; these
tests show that it still steers DualMap's SLO switch and the decode choice, and that a worker
whose metrics cannot be read is served on the router's accounting alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from router.samples import parse_samples, total
from tests.fakes.fake_worker import FakeWorker
from tests.support.router import calls
from tests.support.waiting import eventually

PROMPT = "the quick brown fox jumps over the lazy dog " * 2  # one hashed block or more
POLL_S = 0.05


def _complete(client: httpx.Client, url: str, prompt: str = PROMPT) -> None:
    resp = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt})
    assert resp.status_code == 200, resp.text


def _served_by(client: httpx.Client, url: str, fakes: dict[str, FakeWorker], role: str) -> str:
    """Send one request; the fake worker of ``role`` that got it."""
    before = calls(fakes)
    _complete(client, url)
    after = calls(fakes)
    (wid,) = [w for w, f in fakes.items() if f.role == role and after[w] > before[w]]
    return wid


def _report(client: httpx.Client, url: str, fakes: dict[str, FakeWorker], wid: str,
            **gauges: float) -> dict[str, Any]:
    """Make ``wid`` report ``gauges``; returns its GET /workers entry once the router read them."""
    fakes[wid].gauges.update(gauges)

    def entry() -> dict[str, Any]:
        (found,) = [w for w in client.get(url + "/workers").json()["data"]
                    if w["worker_id"] == wid]
        return found

    return eventually(entry, lambda e: e["reported"] is not None and all(
        e["reported"][k] == v for k, v in gauges.items()), timeout_s=15)


def _metric(client: httpx.Client, url: str, name: str, **labels: str) -> float:
    return total(parse_samples(client.get(url + "/metrics").text), name, **labels)


def _decisions(client: httpx.Client, url: str, reason: str) -> float:
    return _metric(client, url, "pdserve_router_routing_decisions_total", role="prefill",
                   reason=reason)


def test_dualmap_leaves_cache_affinity_when_the_worker_reports_a_queue(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    # 1 ms per token, SLO 1 s: the switch point (0.5 s) is ~500 queued tokens.
    url = start_router(policy="dualmap", ttft_slo_s=1.0, prefill_s_per_token=1e-3,
                       load_poll_interval_s=POLL_S)
    first = _served_by(client, url, fakes, "prefill")
    other = ({"p0", "p1"} - {first}).pop()
    # negative control: nothing reported, the repeated prompt stays where its prefix is cached
    for _ in range(3):
        assert _served_by(client, url, fakes, "prefill") == first
    affinity = _decisions(client, url, "cache_affinity")
    assert affinity >= 3

    # 60 requests queued there by someone else: at this router's mean prompt (> 16 tokens) that
    # is > 960 tokens, ~1 s of predicted TTFT on `first`, past the 0.5 s switch
    entry = _report(client, url, fakes, first, waiting=60)
    assert entry["pending_prefill_tokens"] >= 60 * 16
    for _ in range(3):
        assert _served_by(client, url, fakes, "prefill") == other
    assert _decisions(client, url, "slo_switch") >= 1

    # the queue drains: both hold the prefix now and predict the same TTFT, so the tie goes back
    # to the first ring's candidate, where it all began
    _report(client, url, fakes, first, waiting=0)
    assert _served_by(client, url, fakes, "prefill") == first


def test_kv_aware_decode_avoids_a_worker_whose_kv_cache_is_full(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(decode_policy="kv_aware", load_poll_interval_s=POLL_S)
    # negative control: equal (empty) reports, ties go to the lower worker id
    for _ in range(3):
        assert _served_by(client, url, fakes, "decode") == "d0"
    _report(client, url, fakes, "d0", kv_usage=0.97)  # above kv_aware's 0.95 capacity limit
    for _ in range(5):
        assert _served_by(client, url, fakes, "decode") == "d1"
    _report(client, url, fakes, "d0", kv_usage=0.0)
    assert _served_by(client, url, fakes, "decode") == "d0"


def test_least_loaded_decode_counts_requests_other_routers_sent(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(load_poll_interval_s=POLL_S)  # decode policy: least_loaded (default)
    # negative control: idle pool, sequential requests alternate
    seen = [_served_by(client, url, fakes, "decode") for _ in range(4)]
    assert sorted(seen) == ["d0", "d0", "d1", "d1"]
    entry = _report(client, url, fakes, "d1", running=4)
    assert (entry["in_flight"], entry["running"]) == (0, 4)
    for _ in range(5):
        assert _served_by(client, url, fakes, "decode") == "d0"


def test_unreadable_metrics_fall_back_to_router_accounting(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    fakes["d0"].metrics_status = 500
    url = start_router(load_poll_interval_s=POLL_S)
    eventually(lambda: _metric(client, url, "pdserve_router_worker_load_scrape_failures_total",
                               role="decode"), lambda n: n > 0, timeout_s=15)
    seen = [_served_by(client, url, fakes, "decode") for _ in range(4)]
    assert sorted(seen) == ["d0", "d0", "d1", "d1"]
    reported = {w["worker_id"]: w["reported"] for w in client.get(url + "/workers").json()["data"]}
    assert reported["d0"] is None and reported["d1"] is not None
