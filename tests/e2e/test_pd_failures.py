"""Failure paths of P/D against real workers: corrupted pulls, expired leases, bad input."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LEASE_S
from tests.e2e.test_pd_equivalence import complete
from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm


def test_corrupted_pull_changes_output(pd_cluster: Cluster, plain: Plain,
                                       pd_workers: dict[str, str], tiny_model_dir: Path) -> None:
    """Negative control: the equality tests would catch KV that did not arrive intact."""
    cluster, workers = pd_cluster, pd_workers
    prompts = make_prompts(tiny_model_dir, [150, 400, 900], seed=3,
                           tag=f"corrupt-{cluster.transport}")
    before = scrape(workers["decode"])
    cluster.corrupt_flag.touch()
    try:
        ours = [complete(cluster.url, p)["choices"][0]["text"] for p in prompts]
    finally:
        cluster.corrupt_flag.unlink()
    ref = [complete(plain.url, p)["choices"][0]["text"] for p in prompts]
    after = scrape(workers["decode"])
    assert value(after, "pdserve_kv_pulls_total") - value(before, "pdserve_kv_pulls_total") == 3
    assert ours != ref
    # With the switch off again, the same kind of request is exact.
    clean = make_prompts(tiny_model_dir, [400], seed=3, tag=f"clean-{cluster.transport}")[0]
    assert complete(cluster.url, clean)["choices"][0]["text"] == \
        complete(plain.url, clean)["choices"][0]["text"]


def test_unpulled_lease_expires_and_late_pull_recomputes(pd_cluster: Cluster, plain: Plain,
                                                         pd_workers: dict[str, str],
                                                         tiny_model_dir: Path) -> None:
    cluster, workers = pd_cluster, pd_workers
    prompt = make_prompts(tiny_model_dir, [600], seed=4, tag=f"lease-{cluster.transport}")[0]
    p0 = scrape(workers["prefill"])
    prefill = httpx.post(f"{workers['prefill']}/v1/completions", timeout=60,
                         headers=cluster.worker_auth, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": cluster.sign({"do_remote_decode": True}, workers["prefill"])}).json()
    params = prefill["kv_transfer_params"]
    assert params["remote_block_ids"], params
    assert value(scrape(workers["prefill"]), "vllm:kv_cache_usage_perc") > 0.0

    # Nobody pulls: the lease runs out and the blocks are freed.
    eventually(lambda: value(scrape(workers["prefill"]), "pdserve_kv_leases_expired_total"),
               lambda n: n == value(p0, "pdserve_kv_leases_expired_total") + 1,
               timeout_s=LEASE_S + 20)
    eventually(lambda: value(scrape(workers["prefill"]), "vllm:kv_cache_usage_perc"),
               lambda usage: usage == 0.0, timeout_s=15)

    # A pull after expiry is refused by the release; decode recomputes and is still correct.
    d0 = scrape(workers["decode"])
    late = httpx.post(f"{workers['decode']}/v1/completions", timeout=120,
                      headers=cluster.worker_auth, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "kv_transfer_params": cluster.sign(params, workers["decode"])}).json()
    d1 = scrape(workers["decode"])
    assert late["choices"][0]["text"] == complete(plain.url, prompt)["choices"][0]["text"]
    assert value(d1, "pdserve_kv_pull_failures_total") - \
        value(d0, "pdserve_kv_pull_failures_total") == 1
    assert value(d1, "vllm:prompt_tokens_by_source_total", source="local_compute") - \
        value(d0, "vllm:prompt_tokens_by_source_total", source="local_compute") >= 500


def test_openai_sdk_unmodified(cluster: Cluster, plain: Plain) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    ref_client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Tell me about the copper lantern by the river."}]
    chunks = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    ref = ref_client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=10,
                                             temperature=0)
    assert text == ref.choices[0].message.content
    done = client.completions.create(model=SERVED_NAME, prompt="violet orbit", max_tokens=8,
                                     temperature=0)
    assert done.choices[0].text == ref_client.completions.create(
        model=SERVED_NAME, prompt="violet orbit", max_tokens=8, temperature=0).choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": 3}, 400, "missing_field"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model_not_found"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": -4}, 400,
     "invalid_value"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "river " * 5000, "max_tokens": 4}, 400,
     "context_length_exceeded"),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), BAD_REQUESTS)
def test_bad_request_is_rejected_before_any_worker(cluster: Cluster, workers: dict[str, str],
                                                   path: str, body: object, status: int,
                                                   code: str) -> None:
    before = {role: scrape(url) for role, url in workers.items()}
    if isinstance(body, bytes):
        resp = httpx.post(f"{cluster.url}{path}", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    else:
        resp = httpx.post(f"{cluster.url}{path}", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error and "param" in error
    assert resp.headers.get("x-request-id")
    for role, url in workers.items():
        after = scrape(url)
        assert value(after, "vllm:request_success_total") == \
            value(before[role], "vllm:request_success_total")
        assert value(after, "vllm:prompt_tokens_total") == \
            value(before[role], "vllm:prompt_tokens_total")
