"""The real router under uvicorn, real Redis, fake workers: API keys and signed KV params."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import pytest

from kvtransfer.signing import SIGNATURE_KEY, TARGET_KEY, Keyring, strip_signature
from serve.redis_server import RedisServer
from tests.fakes.fake_worker import FAKE_CLUSTER_SECRET, FakeWorker
from tests.support.router import calls, deregister, register

KEY = "sk-test-0123456789"
ADMIN = "sk-admin-0123456789"
SECRET = FAKE_CLUSTER_SECRET
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 4}


def test_api_key_guards_the_api_and_workers_but_not_probes(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(api_keys=(KEY, "sk-second-key-000"), admin_api_keys=(ADMIN,))
    for headers, code in (({}, "missing_api_key"),
                          ({"Authorization": "Bearer sk-wrong"}, "invalid_api_key"),
                          ({"Authorization": f"Basic {KEY}"}, "invalid_api_key")):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/workers")):
            resp = client.request(method, url + path, headers=headers,
                                  json=BODY if method == "POST" else None)
            assert resp.status_code == 401, (path, resp.text)
            assert resp.json()["error"]["code"] == code
            assert resp.json()["error"]["type"] == "invalid_request_error"
            assert resp.headers["x-request-id"]
    assert calls(fakes) == {"p0": 0, "p1": 0, "d0": 0, "d1": 0}  # nothing reached a worker
    assert client.get(url + "/health").status_code == 200
    assert client.get(url + "/metrics").status_code == 200

    ok = client.post(url + "/v1/completions", json=BODY,
                     headers={"Authorization": "Bearer sk-second-key-000"})
    assert ok.status_code == 200, ok.text
    # /workers (internal URLs, loads, a prompt oracle) is for admins: 403 for a client key
    # (review finding 10); control: the admin key reads it, and works on the API too.
    denied = client.get(url + "/workers", params={"prompt": "a guess at another tenant"},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_key_required"
    assert client.get(url + "/workers", headers={"Authorization": f"Bearer {ADMIN}"}
                      ).status_code == 200
    assert client.post(url + "/v1/completions", json=BODY,
                       headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    # The router's key is not handed on to the workers.
    sent = [r for f in fakes.values() for r in f.requests]
    assert sent and all("authorization" not in r.headers for r in sent)


def test_without_api_keys_everything_is_open(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Negative control: the 401s above come from the keys, not from the setup."""
    url = start_router()
    assert client.post(url + "/v1/completions", json=BODY).status_code == 200
    assert client.get(url + "/workers").status_code == 200


def test_router_signs_what_it_sends_and_clients_cannot_set_kv_params(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(cluster_secret=SECRET)
    resp = client.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    ring = Keyring.parse(SECRET)
    sent = [(f, r) for f in fakes.values() for r in f.requests]
    (p_fake, prefill), = [(f, r) for f, r in sent if f.role == "prefill"]
    (d_fake, decode), = [(f, r) for f, r in sent if f.role == "decode"]
    for fake, request in ((p_fake, prefill), (d_fake, decode)):
        params = request.body["kv_transfer_params"]
        assert SIGNATURE_KEY in params
        assert ring.verify(params, time.time()) is None
        assert params[TARGET_KEY] == fake.engine_id  # bound to the worker it was sent to
    assert strip_signature(prefill.body["kv_transfer_params"]) == {"do_remote_decode": True}
    assert decode.body["kv_transfer_params"]["do_remote_prefill"] is True
    # Another secret does not verify them.
    assert Keyring.parse("another-secret-0123456789-0123456789").verify(
        decode.body["kv_transfer_params"], time.time()) == "bad signature"

    before = sum(len(f.requests) for f in fakes.values())
    bad = client.post(url + "/v1/completions",
                      json={**BODY, "kv_transfer_params": {"do_remote_decode": True}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "kv_transfer_params"
    assert sum(len(f.requests) for f in fakes.values()) == before


def test_a_prefill_answering_another_address_is_not_signed_for(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Security review finding 5: a prefill whose params name a UCX address other than its
    registered one (a rogue or confused worker) gets nothing signed: no decode is sent to read
    from it. Control: the first test of this module, where the same prefill's own params are
    signed and forwarded."""
    for fake in fakes.values():
        if fake.role == "prefill":
            fake.mode = "foreign_kv_params"
    url = start_router(cluster_secret=SECRET, prefill_retries=0)
    resp = client.post(url + "/v1/completions", json=BODY)
    # the decode serves the request whole (role fallback), reading from nobody
    assert resp.status_code == 200, resp.text
    (sent,) = [r for f in fakes.values() if f.role == "decode" for r in f.requests]
    assert "kv_transfer_params" not in sent.body
    assert 'pdserve_router_upstream_errors_total{kind="foreign_kv_params",role="prefill"} 1.0' \
        in client.get(url + "/metrics").text


def test_a_registration_without_the_cluster_secret_gets_no_request(
        fakes: dict[str, FakeWorker], redis_server: RedisServer,
        start_router: Callable[..., str], client: httpx.Client) -> None:
    """Security review finding 4: whoever can write Redis (the password) but lacks the
    cluster secret registers a prefill, unsigned or signed with another secret; a router with
    the secret never sends it a prompt nor lists it. Control: a router without a secret (an
    insecure cluster) takes the same registration and routes to it."""
    model_path = fakes["p0"].model_path
    rogues = [FakeWorker("p-unsigned", "prefill", model_path=model_path,
                         cluster_secret=None).start(),
              FakeWorker("p-foreign", "prefill", model_path=model_path,
                         cluster_secret="another-cluster-secret-0123456789").start()]
    register(redis_server.url, [r.record() for r in rogues])
    try:
        url = start_router(cluster_secret=SECRET)
        listed = {w["worker_id"] for w in client.get(url + "/workers").json()["data"]}
        assert listed == set(fakes), listed
        for _ in range(8):
            assert client.post(url + "/v1/completions", json=BODY).status_code == 200
        assert [len(r.requests) for r in rogues] == [0, 0]
        assert sum(len(f.requests) for f in fakes.values() if f.role == "prefill") == 8
        insecure = start_router()
        for _ in range(8):
            assert client.post(insecure + "/v1/completions", json=BODY).status_code == 200
        assert all(len(r.requests) > 0 for r in rogues)  # round robin over four prefills
    finally:
        deregister(redis_server.url, [r.worker_id for r in rogues])
        for rogue in rogues:
            rogue.stop()


def test_a_failed_request_names_no_worker_and_quotes_no_worker_text(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str], client: httpx.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    """Security review finding 21: when every worker fails, the client learns the role and
    the kind of failure, not worker ids (pod host names) nor the worker's own error text;
    the router's log keeps both (the control: the detail existed and was recorded)."""
    for fake in fakes.values():
        fake.mode = "error_500"
    url = start_router()
    with caplog.at_level(logging.WARNING):
        resp = client.post(url + "/v1/completions", json=BODY)
    assert resp.status_code >= 500, resp.text
    message = resp.json()["error"]["message"]
    assert "worker failed" in message, message
    assert not any(wid in message for wid in fakes) and "injected failure" not in message
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "injected failure" in logged and any(wid in logged for wid in fakes)
