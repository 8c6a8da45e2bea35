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
from tests.support.cluster import SERVED_NAME, Cluster, Plain, registered_records
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
LEASE = {"do_remote_decode": True}


AUTH: dict[str, str] = {}
"""The session cluster's worker API key header (set by the autouse fixture below)."""


@pytest.fixture(autouse=True)
def _worker_auth(cluster: Cluster) -> None:
    AUTH.update(cluster.worker_auth)


def _post(url: str, prompt: str, params: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/completions", timeout=120, headers=AUTH, json={
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

    signed = _post(workers["prefill"], prompt, cluster.sign(LEASE, workers["prefill"]), 1)
    params = signed["kv_transfer_params"]
    assert params and params["remote_block_ids"]
    assert _refused(workers["prefill"]) == refused + 1
    # Pull it (as the router would), which also ends the lease.
    pulls = value(scrape(workers["decode"]), "pdserve_kv_pulls_total")
    out = _post(workers["decode"], prompt, cluster.sign(params, workers["decode"]), MAX_TOKENS)
    assert out["choices"][0]["text"] == complete(plain.url, prompt)["choices"][0]["text"]
    assert value(scrape(workers["decode"]), "pdserve_kv_pulls_total") == pulls + 1


def test_decode_reads_only_from_signed_params(cluster: Cluster, plain: Plain,
                                              workers: dict[str, str],
                                              tiny_model_dir: Path) -> None:
    """A client that reaches the decode directly cannot choose what it reads."""
    prompt, other = make_prompts(tiny_model_dir, [400, 400], seed=22, tag="forge")
    ref = complete(plain.url, prompt)["choices"][0]["text"]
    # Another request's blocks, pulled later under this request's lease: a forged read.
    victim = _post(workers["prefill"], other, cluster.sign(LEASE, workers["prefill"]), 1)
    mine = _post(workers["prefill"], prompt, cluster.sign(LEASE, workers["prefill"]), 1)
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
    _post(workers["decode"], prompt, cluster.sign(forged, workers["decode"]), MAX_TOKENS)
    assert value(scrape(workers["decode"]), "pdserve_kv_pulls_total") == \
        value(after, "pdserve_kv_pulls_total") + 1
    # End the victim's lease the normal way.
    _post(workers["decode"], other,
          cluster.sign(victim["kv_transfer_params"], workers["decode"]), 2)


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
        resp = httpx.post(f"{url}/v1/completions", timeout=120, headers=AUTH, json={
            "model": SERVED_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0,
            "vllm_xargs": {"kv_transfer_params": bad}})
        assert resp.status_code in (200, 400, 500), resp.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    out = httpx.post(f"{url}/v1/completions", timeout=120, headers=AUTH, json={
        "model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}).json()
    assert out["choices"][0]["text"] == complete(plain.url, "hello", max_tokens=4)[
        "choices"][0]["text"]


def test_a_signed_blob_is_good_once_and_only_where_it_was_sent(
        cluster: Cluster, plain: Plain, workers: dict[str, str], tiny_model_dir: Path) -> None:
    """Security review finding 5: a signature is a capability for one call to one engine. A
    replayed prefill blob pins nothing more; a decode blob shown to another engine, or shown
    twice, reads nothing (served plain, still correct). Control: each blob's first use where
    it was sent is acted on."""
    prompt = make_prompts(tiny_model_dir, [300], seed=23, tag="once")[0]
    ref = complete(plain.url, prompt)["choices"][0]["text"]
    ask = cluster.sign(LEASE, workers["prefill"])
    params = _post(workers["prefill"], prompt, ask, 1).get("kv_transfer_params")
    assert params and params["remote_block_ids"]  # control: the first use leases
    refused = _refused(workers["prefill"])
    assert not _post(workers["prefill"], prompt, ask, 1).get("kv_transfer_params")
    assert _refused(workers["prefill"]) == refused + 1

    elsewhere = cluster.sign(params, workers["prefill"])  # signed for the prefill's engine
    blob = cluster.sign(params, workers["decode"])
    before = scrape(workers["decode"])
    for attempt in (elsewhere, blob, blob):
        out = _post(workers["decode"], prompt, attempt, MAX_TOKENS)
        assert out["choices"][0]["text"] == ref
    after = scrape(workers["decode"])
    assert value(after, "pdserve_kv_pulls_total") == value(before, "pdserve_kv_pulls_total") + 1
    assert value(after, "pdserve_kv_refused_params_total") == \
        value(before, "pdserve_kv_refused_params_total") + 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_port_serves_only_the_router(cluster: Cluster, workers: dict[str, str],
                                              role: str) -> None:
    """Security review finding 6: a caller that reaches a worker's port directly (bypassing
    the router's API keys, admission and accounting) is refused on ``/v1``, without a key or
    with a guessed one; control: the key the router derives from the cluster secret works.
    ``/health`` and ``/metrics`` stay open for probes and Prometheus."""
    url = workers[role]
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"authorization": "Bearer guessed"}):
        assert httpx.post(f"{url}/v1/completions", json=body, headers=headers,
                          timeout=60).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=headers, timeout=10).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH,
                      timeout=120).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200


def _listening(pids: set[int], exclude_ports: frozenset[int] = frozenset()) -> set[str]:
    """Addresses the processes ``pids`` accept TCP connections on (ports in
    ``exclude_ports`` left out)."""
    import psutil

    return {conn.laddr.ip for conn in psutil.net_connections("tcp")
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids
            and conn.laddr.port not in exclude_ports}


def _non_loopback_ip() -> str | None:
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family.name == "AF_INET" and not addr.address.startswith("127."):
                return str(addr.address)
    return None


def test_a_loopback_cluster_keeps_its_ucx_off_every_other_interface(cluster: Cluster) -> None:
    """UCX over tcp serves RMA to whoever reaches its port (security review finding 1), so
    `pdserve up` on loopback confines the workers' UCX (UCX_NET_DEVICES=lo): no process of the
    cluster listens beyond 127.0.0.1. Control: a UCX engine started without that setting
    listens on the machine's other interface."""
    import psutil

    from kvtransfer.transport.ucx import UcxEngine

    tree = {p.pid for p in psutil.Process(cluster.proc.pid).children(recursive=True)}
    # the KV events (on in the session cluster) ride Unix sockets on loopback (finding 9):
    # vLLM would bind a port on every interface
    events = [w.kv_events_endpoint for w in registered_records(cluster) if w.kv_events_endpoint]
    assert events and all(e.startswith("ipc://") for e in events), events
    listening = _listening(tree)
    assert listening and listening <= {"127.0.0.1"}, (
        listening, [(c.pid, c.laddr) for c in psutil.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.pid in tree])
    other = _non_loopback_ip()
    if other is None:
        pytest.skip("no interface besides loopback: the control cannot run")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("UCX_NET_DEVICES", raising=False)
        engine = UcxEngine(name="control", same_host=False)
    try:
        assert other in _listening({psutil.Process().pid})
    finally:
        engine.close()
