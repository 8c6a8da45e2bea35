"""Workers trust only the router: unsigned kv_transfer_params neither lease nor read KV.

Every case has its control in the same cluster: the same request, signed with the cluster
secret (what the router does), is acted on, so the refusals cannot pass vacuously.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_pd_equivalence import complete
from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


def _post(url: str, prompt: str, params: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _refused(url: str) -> float:
    return value(scrape(url), "pdserve_kv_refused_params_total")


def test_prefill_leases_only_for_signed_params(cluster: Cluster, plain: Plain,
                                               workers: dict[str, str],
                                               tiny_model_dir: Path) -> None:
    prompt = make_prompts(tiny_model_dir, [300], seed=21, tag="pin")[0]
    refused = _refused(workers["prefill"])
    unsigned = _post(workers["prefill"], prompt, {"do_remote_decode": True}, 1)
    assert not unsigned.get("kv_transfer_params")  # no lease, nothing to pull
    assert _refused(workers["prefill"]) == refused + 1

    signed = _post(workers["prefill"], prompt, cluster.sign({"do_remote_decode": True}), 1)
    params = signed["kv_transfer_params"]
    assert params and params["remote_block_ids"]
    assert _refused(workers["prefill"]) == refused + 1
    # Pull it (as the router would), which also ends the lease.
    pulls = value(scrape(workers["decode"]), "pdserve_kv_pulls_total")
    out = _post(workers["decode"], prompt, cluster.sign(params), MAX_TOKENS)
    assert out["choices"][0]["text"] == complete(plain.url, prompt)["choices"][0]["text"]
    assert value(scrape(workers["decode"]), "pdserve_kv_pulls_total") == pulls + 1


def test_decode_reads_only_from_signed_params(cluster: Cluster, plain: Plain,
                                              workers: dict[str, str],
                                              tiny_model_dir: Path) -> None:
    """A client that reaches the decode directly cannot choose what it reads."""
    prompt, other = make_prompts(tiny_model_dir, [400, 400], seed=22, tag="forge")
    ref = complete(plain.url, prompt)["choices"][0]["text"]
    # Another request's blocks, pulled later under this request's lease: a forged read.
    victim = _post(workers["prefill"], other, cluster.sign({"do_remote_decode": True}), 1)
    mine = _post(workers["prefill"], prompt, cluster.sign({"do_remote_decode": True}), 1)
    forged = {**mine["kv_transfer_params"],
              "remote_block_ids": victim["kv_transfer_params"]["remote_block_ids"]}

    before = scrape(workers["decode"])
    out = _post(workers["decode"], prompt, forged, MAX_TOKENS)
    after = scrape(workers["decode"])
    assert out["choices"][0]["text"] == ref  # computed locally
    assert value(after, "pdserve_kv_refused_params_total") == \
        value(before, "pdserve_kv_refused_params_total") + 1
    for name in ("pdserve_kv_pulls_total", "pdserve_kv_pull_failures_total"):
        assert value(after, name) == value(before, name), name

    # Control: the same forged params with a valid signature are read from.
    _post(workers["decode"], prompt, cluster.sign(forged), MAX_TOKENS)
    assert value(scrape(workers["decode"]), "pdserve_kv_pulls_total") == \
        value(after, "pdserve_kv_pulls_total") + 1
    # End the victim's lease the normal way.
    _post(workers["decode"], other, cluster.sign(victim["kv_transfer_params"]), 2)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_xargs_kv_params_do_not_kill_a_worker(cluster: Cluster, plain: Plain,
                                                   workers: dict[str, str], role: str) -> None:
    """Security review finding 7: vLLM copies ``vllm_xargs.kv_transfer_params`` (a string or
    a list is allowed there) into the engine's request, where calling ``.get`` on it in the
    scheduler kills the EngineCore. A caller that reaches a worker port directly sends it: the
    worker may refuse that one request (vLLM 0.32's API server fails it with a 500 before the
    engine sees it; the connector drops such params if they get there), but the engine lives
    and serves the next request. (The router refuses the field with a 400:
    tests/unit/test_router_untrusted_fields.py; the connector's guard:
    tests/unit/test_kv_scheduler_renewal.py.)"""
    url = workers[role]
    for bad in ("x", ["do_remote_prefill"], ""):
        resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0,
            "vllm_xargs": {"kv_transfer_params": bad}})
        assert resp.status_code in (200, 400, 500), resp.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    out = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}).json()
    assert out["choices"][0]["text"] == complete(plain.url, "hello", max_tokens=4)[
        "choices"][0]["text"]
