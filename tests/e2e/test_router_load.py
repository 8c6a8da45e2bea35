"""The router reads real vLLM workers' own load (``GET /workers``), including load it did not
send: a generation started straight on the decode worker, past the router."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm


def _entry(cluster: Cluster, role: str) -> dict[str, Any]:
    (found,) = [w for w in httpx.get(f"{cluster.url}/workers", timeout=10).json()["data"]
                if w["role"] == role]
    return found


def test_router_counts_a_generation_it_did_not_send(cluster: Cluster,
                                                    workers: dict[str, str]) -> None:
    for role in ("prefill", "decode"):  # real vLLM's gauges parse for both pools
        eventually(lambda r=role: _entry(cluster, r), lambda e: e["reported"] is not None,
                   timeout_s=30)
    # the cluster is shared: let an earlier test's last stream finish on both sides (vLLM and
    # this router's accounting) so the one sequence below is the only one either side counts
    eventually(lambda: _entry(cluster, "decode"),
               lambda e: e["in_flight"] == 0 and e["reported"]["running"] == 0, timeout_s=30)
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    started, stop = threading.Event(), threading.Event()

    def generate() -> None:
        with httpx.stream("POST", f"{workers['decode']}/v1/completions", json=body,
                          timeout=120, headers=cluster.worker_auth) as resp:
            assert resp.status_code == 200
            for _line in resp.iter_lines():
                started.set()
                if stop.is_set():
                    return  # closing the stream aborts the generation

    client = threading.Thread(target=generate, daemon=True)
    client.start()
    try:
        assert started.wait(60), "the generation never started"
        # a scrape pairs vLLM's gauge with this router's in-flight count at the moment it
        # lands; the next scrape (1 s) converges if the two were read across a stream's end
        busy = eventually(lambda: _entry(cluster, "decode"),
                          lambda e: e["reported"]["running"] == 1 and e["running"] == 1,
                          timeout_s=30)
    finally:
        stop.set()
        client.join(timeout=60)
    # not the router's request, but the decode choice saw one running sequence and its KV
    assert busy["in_flight"] == 0 and busy["running"] == 1
    assert busy["reported"]["kv_usage"] > 0
    idle = eventually(lambda: _entry(cluster, "decode"),
                      lambda e: e["reported"]["running"] == 0, timeout_s=30)
    assert idle["running"] == 0
