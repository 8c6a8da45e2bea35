"""Leases against the real UCX cluster: a renewed lease outlives its length and the decode's
late pull succeeds; the same pull without renewal fails (the lease expired). A lease is
one-shot and bound to its token: a peer on the control channel cannot release it twice, nor
release or renew it without the token from the signed params. A client that leaves before its
decode starts does not pin the prefill's KV for the lease (the router releases it)."""

from __future__ import annotations

import json
import socket
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
from tests.support.router_process import RouterProcess
from tests.support.waiting import eventually

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
    # A peer that never proved a lease is not answered at all: the prefill opens no connection
    # to the address it names (finding 15), and counts the dropped answer.
    with UcxEngine(name="test-stranger", same_host=False) as stranger:
        unanswered = stranger.connect(hs.ucx_address).request(release_message(rid, "guessed"))
        eventually(lambda: value(scrape(workers["prefill"]),
                                 "pdserve_kv_control_unanswered_total"),
                   lambda n: n > value(p0, "pdserve_kv_control_unanswered_total"),
                   timeout_s=30)
        assert unanswered.poll() == "pending"
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
        value(p0, "pdserve_kv_leases_refused_total") == 4
    # control: the rogue that proved a lease first was answered every time
    assert value(p1, "pdserve_kv_control_unanswered_total") - \
        value(p0, "pdserve_kv_control_unanswered_total") == 1


def _leave_during_prefill(router_url: str, prompt: str) -> None:
    """Send a streamed request and hang up while the router waits on its prefill (the client
    gone before its first event), without reading a byte."""
    host, port = router_url.split("//", 1)[1].rsplit(":", 1)
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16,
                       "temperature": 0, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        eventually(lambda: value(scrape(router_url), "pdserve_router_in_flight_requests",
                                 role="prefill"), lambda n: n >= 1, timeout_s=30,
                   interval_s=0.002)
        sock.setblocking(False)
        try:
            early = sock.recv(1)
        except BlockingIOError:
            early = b""
        assert not early, "the answer started before the client left: nothing was tested"


def _lease_ends(prefill_url: str) -> tuple[float, float]:
    samples = scrape(prefill_url)
    return (value(samples, "pdserve_kv_leases_released_total"),
            value(samples, "pdserve_kv_leases_expired_total"))


def test_a_client_gone_before_its_first_token_does_not_pin_the_prefill_kv(
        cluster: Cluster, workers: dict[str, str], tiny_model_dir: Path) -> None:
    """Security review finding 14. A streamed client that leaves while its prefill runs never
    gets a decode, so nobody would release the prefill's lease: its KV stayed pinned for the
    whole lease. The router now releases it through a decode at once (vLLM frees the params of
    a request its API server rejects), so the lease ends released, not expired.
    Control: a router with ``release_unspent_kv`` off leaves the same lease to expire."""
    # prompts long enough that their prefill outlasts many polls of the router's gauge
    ours, theirs = make_prompts(tiny_model_dir, [3500, 3500], seed=34, tag="gone")
    control = RouterProcess(redis_url=cluster.redis_url, release_unspent_kv=False,
                            cluster_secret_file=str(cluster.keyring_file)).start(timeout_s=60)
    metric = "pdserve_router_unspent_kv_releases_total"
    try:
        for url in (cluster.url, control.url):  # routers load their tokenizer on first use
            httpx.post(url + "/v1/completions", timeout=60, json={
                "model": SERVED_NAME, "prompt": "warm", "max_tokens": 2}).raise_for_status()
        released0 = value(scrape(cluster.url), metric, outcome="released")
        ends = []
        for url, prompt in ((cluster.url, ours), (control.url, theirs)):
            # no other lease may end meanwhile: earlier tests' unpulled ones expire first
            eventually(lambda: value(scrape(workers["prefill"]), "vllm:kv_cache_usage_perc"),
                       lambda usage: usage == 0.0, timeout_s=LEASE_S + 30)
            before = _lease_ends(workers["prefill"])
            _leave_during_prefill(url, prompt)
            after = eventually(lambda: _lease_ends(workers["prefill"]),
                               lambda n: sum(n) == sum(before) + 1,  # noqa: B023
                               timeout_s=LEASE_S + 30)
            ends.append((after[0] - before[0], after[1] - before[1]))
        released = value(scrape(cluster.url), metric, outcome="released") - released0
        control_released = value(scrape(control.url), metric, outcome="released")
    finally:
        control.stop()
    assert ends[0] == (1, 0)  # released through the decode, before it could expire
    assert ends[1] == (0, 1)  # control: pinned until the lease ran out
    assert (released, control_released) == (1, 0)
