"""The router learns the prefill engine's cache from its KV cache events (`pdserve up
--kv-events`, the session cluster): a prompt the router never routed, sent straight to the
prefill worker, ends up in the router's cache model for that worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, registered_workers
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm

STORED = "pdserve_router_kv_events_total"


def _prefill_entry(cluster: Cluster, prompt: str) -> dict[str, Any]:
    data = httpx.get(f"{cluster.url}/workers", params={"prompt": prompt}, timeout=30,
                     trust_env=False).json()["data"]
    (entry,) = [w for w in data if w["role"] == "prefill"]
    return entry  # type: ignore[no-any-return]


def test_the_router_learns_a_prompt_from_the_prefill_engines_events(
        cluster: Cluster, tiny_model_dir: Path) -> None:
    (prompt,) = make_prompts(tiny_model_dir, [700], seed=23, tag="kv-events")
    before = _prefill_entry(cluster, prompt)
    assert before["cached_prompt_tokens"] == 0  # negative control: nobody sent it anywhere
    assert before["kv_events"] is not None, "the router does not follow the prefill's events"
    # on loopback the events ride a private Unix socket, not a port on every interface
    assert before["kv_events"]["endpoint"].startswith("ipc://"), before["kv_events"]
    stored0 = value(scrape(cluster.url), STORED, kind="stored")
    # straight to the prefill worker: the router neither routes nor records this request
    prefill_url = registered_workers(cluster)["prefill"]
    resp = httpx.post(f"{prefill_url}/v1/completions", timeout=120, trust_env=False,
                      headers=cluster.worker_auth, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]

    def whole_blocks(entry: dict[str, Any]) -> int:
        block = entry["kv_events"]["engine_block_tokens"]  # known from the first BlockStored
        return prompt_tokens // block * block if block else -1

    # every full engine block of the prompt, re-hashed by the router from vLLM's token ids, is
    # found with the hashes of the prompt as the router tokenizes it: the hash spaces agree
    after = eventually(lambda: _prefill_entry(cluster, prompt),
                       lambda e: e["cached_prompt_tokens"] == whole_blocks(e), timeout_s=30)
    assert after["kv_events"]["engine_block_tokens"] % 16 == 0
    assert after["cached_prompt_tokens"] >= 512  # 700 tokens: at least 4 blocks of 128
    assert value(scrape(cluster.url), STORED, kind="stored") > stored0
    assert after["kv_events"]["events"].get("refused", 0) == 0
