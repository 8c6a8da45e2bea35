"""Leases against the real UCX cluster: a renewed lease outlives its length and the decode's
late pull succeeds; the same pull without renewal fails (the lease expired). A lease is
one-shot and bound to its token: a peer on the control channel cannot release it twice, nor
release or renew it without the token from the signed params."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtransfer.protocol import (
    RELEASE_EXPIRED,
    RELEASE_OK,
    Handshake,
    release_message,
    renew_message,
)
from kvtransfer.transport.ucx import UcxEngine
from tests.e2e.conftest import LEASE_S
from tests.e2e.test_pd_equivalence import complete
from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.vllm


def _prefill(cluster: Cluster, url: str, prompt: str) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/completions", timeout=60, headers=cluster.worker_auth, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": cluster.sign({"do_remote_decode": True}, url)})
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _decode(cluster: Cluster, url: str, prompt: str, params: dict[str, Any]) -> str:
    resp = httpx.post(f"{url}/v1/completions", timeout=120, headers=cluster.worker_auth, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "kv_transfer_params": cluster.sign(params, url)})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def _ask(peer: Any, payload: bytes) -> bytes:
    reply = peer.request(payload)
    reply.wait(10.0)
    return bytes(reply.result())


def test_renewed_lease_outlives_its_length(cluster: Cluster, plain: Plain,
                                           workers: dict[str, str],
                                           tiny_model_dir: Path) -> None:
    renewed, lapsed = make_prompts(tiny_model_dir, [500, 500], seed=31, tag="renew")
    keep = _prefill(cluster, workers["prefill"], renewed)
    drop = _prefill(cluster, workers["prefill"], lapsed)
    hs = Handshake.from_wire(keep["remote_handshake"])
    p0 = scrape(workers["prefill"])
    with UcxEngine(name="test-renewer", same_host=False) as engine:
        peer = engine.connect(hs.ucx_address)
        deadline = time.monotonic() + LEASE_S + 4.0  # past the lease of both requests
        while time.monotonic() < deadline:  # what a decode does while the request queues
            assert _ask(peer, renew_message(keep["remote_request_id"],
                                            keep["remote_lease_token"])) == RELEASE_OK
            time.sleep(LEASE_S / 3)
    d0 = scrape(workers["decode"])
    assert _decode(cluster, workers["decode"], renewed, keep) == \
        complete(plain.url, renewed)["choices"][0]["text"]
    d1 = scrape(workers["decode"])
    assert value(d1, "pdserve_kv_pulls_total") == value(d0, "pdserve_kv_pulls_total") + 1
    assert value(d1, "pdserve_kv_pull_failures_total") == \
        value(d0, "pdserve_kv_pull_failures_total")
    # Negative control: the request nobody renewed lapsed; its pull fails and is recomputed.
    assert _decode(cluster, workers["decode"], lapsed, drop) == \
        complete(plain.url, lapsed)["choices"][0]["text"]
    d2 = scrape(workers["decode"])
    assert value(d2, "pdserve_kv_pull_failures_total") == \
        value(d1, "pdserve_kv_pull_failures_total") + 1
    p1 = scrape(workers["prefill"])
    assert value(p1, "pdserve_kv_leases_renewed_total") - \
        value(p0, "pdserve_kv_leases_renewed_total") >= 3


def test_a_lease_is_released_once_and_only_with_its_token(cluster: Cluster, plain: Plain,
                                                          workers: dict[str, str],
                                                          tiny_model_dir: Path) -> None:
    """Security review findings 2 and 8, against the real prefill's control channel. A repeat
    release (what a retried decode sent before the fix) is answered "expired", so a second
    reader of the freed blocks recomputes; a release or renewal with a guessed token is
    refused and leaves the lease held for its real reader."""
    spent_prompt, held_prompt = make_prompts(tiny_model_dir, [300, 300], seed=32, tag="once")
    spent = _prefill(cluster, workers["prefill"], spent_prompt)
    held = _prefill(cluster, workers["prefill"], held_prompt)
    hs = Handshake.from_wire(spent["remote_handshake"])
    p0 = scrape(workers["prefill"])
    with UcxEngine(name="test-rogue", same_host=False) as engine:
        peer = engine.connect(hs.ucx_address)
        done = release_message(spent["remote_request_id"], spent["remote_lease_token"])
        assert _ask(peer, done) == RELEASE_OK  # control: the first release is valid
        assert _ask(peer, done) == RELEASE_EXPIRED  # the repeat: blocks may be reused
        rid = held["remote_request_id"]
        assert _ask(peer, release_message(rid, "guessed")) == RELEASE_EXPIRED
        assert _ask(peer, renew_message(rid, "guessed")) == RELEASE_EXPIRED
    # The forged release did not end the lease: its real reader still pulls it.
    d0 = scrape(workers["decode"])
    assert _decode(cluster, workers["decode"], held_prompt, held) == \
        complete(plain.url, held_prompt)["choices"][0]["text"]
    d1 = scrape(workers["decode"])
    assert value(d1, "pdserve_kv_pulls_total") == value(d0, "pdserve_kv_pulls_total") + 1
    assert value(d1, "pdserve_kv_pull_failures_total") == \
        value(d0, "pdserve_kv_pull_failures_total")
    p1 = scrape(workers["prefill"])
    assert value(p1, "pdserve_kv_leases_refused_total") - \
        value(p0, "pdserve_kv_leases_refused_total") == 3
