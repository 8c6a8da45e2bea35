"""Per-key ``cache_salt`` keeps tenants' prefix caches apart in the real vLLM prefill (security
review row 10): a router with ``--cache-salt-per-key`` in front of the session's workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, registered_records
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.router_process import RouterProcess

pytestmark = pytest.mark.vllm

KEYS = ("tenant-a-key", "tenant-b-key")


@pytest.fixture(scope="module")
def salted(cluster: Cluster) -> Iterator[str]:
    """A router with API keys and a salt per key, on the session cluster's Redis and secret."""
    router = RouterProcess(redis_url=cluster.redis_url,
                           cluster_secret_file=str(cluster.keyring_file), api_keys=list(KEYS),
                           cache_salt_per_key=True)
    router.start(timeout_s=60)
    try:
        yield router.url
    finally:
        router.stop()


def _prefill_hits(cluster: Cluster) -> float:
    """Prompt tokens the prefill engine found in its prefix cache so far."""
    (prefill,) = [r for r in registered_records(cluster) if r.role == "prefill"]
    return value(scrape(prefill.http_url), "vllm:prefix_cache_hits_total")


def _ask(url: str, key: str, prompt: str) -> None:
    resp = httpx.post(f"{url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2,
                            "temperature": 0})
    assert resp.status_code == 200, resp.text


def test_one_keys_prompt_is_not_a_cache_hit_for_another_key(
        cluster: Cluster, salted: str, tiny_model_dir: Path) -> None:
    (prompt,) = make_prompts(tiny_model_dir, [600], seed=97, tag="salt")
    before = _prefill_hits(cluster)
    _ask(salted, KEYS[0], prompt)
    first = _prefill_hits(cluster)
    _ask(salted, KEYS[0], prompt)  # control: the same key reuses its own prefix
    same_key = _prefill_hits(cluster) - first
    _ask(salted, KEYS[1], prompt)
    other_key = _prefill_hits(cluster) - first - same_key
    assert first - before < 32, first - before  # a new prompt: (almost) nothing cached
    assert same_key >= 512, same_key  # 600 tokens: all full blocks but the last
    assert other_key < 32, other_key  # the other tenant's salt: no block is shared
