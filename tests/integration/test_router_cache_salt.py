"""Per-key ``cache_salt`` (security review row 10, ``--cache-salt-per-key``): what the workers
receive. Real router under uvicorn, real Redis, fake workers that record every body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.fakes.fake_worker import FakeWorker
from tests.support.router import stream_request

BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 6}
KEY_A, KEY_B = "sk-tenant-a-0000000000", "sk-tenant-b-0000000000"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _bodies(fakes: dict[str, FakeWorker]) -> list[dict[str, Any]]:
    """Every body the fakes received since the last call (then forgotten)."""
    out = [r.body for fake in fakes.values() for r in fake.requests]
    for fake in fakes.values():
        fake.requests.clear()
    return out


def _salts_of(key: str, url: str, client: httpx.Client, fakes: dict[str, FakeWorker],
              body: dict[str, Any] = BODY) -> set[object]:
    resp = client.post(url + "/v1/completions", headers=_auth(key), json=body)
    assert resp.status_code == 200, resp.text
    bodies = _bodies(fakes)
    assert len(bodies) == 2  # a prefill and a decode
    return {b.get("cache_salt") for b in bodies}


def test_each_key_reaches_the_workers_under_its_own_salt(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(api_keys=(KEY_A, KEY_B), cache_salt_per_key=True)
    a = _salts_of(KEY_A, url, client, fakes)
    a_again = _salts_of(KEY_A, url, client, fakes)
    b = _salts_of(KEY_B, url, client, fakes)
    # prefill and decode carry one salt; the same key twice, the same one
    assert len(a) == len(b) == 1 and a == a_again
    (salt_a,), (salt_b,) = a, b
    assert isinstance(salt_a, str) and isinstance(salt_b, str) and salt_a and salt_b
    assert salt_a != salt_b
    assert KEY_A not in salt_a and KEY_B not in salt_b  # derived, never the key
    # a salt the client sends is combined with its key's, never used alone
    (mine,) = _salts_of(KEY_A, url, client, fakes, {**BODY, "cache_salt": salt_b})
    assert mine not in (salt_a, salt_b)
    bad = client.post(url + "/v1/completions", headers=_auth(KEY_A),
                      json={**BODY, "cache_salt": "a/b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    assert _bodies(fakes) == []


def test_a_stream_that_moves_keeps_its_keys_salt(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """The continuation a moved stream sends (a new request, the prompt's ids plus the ids
    already sent) carries the salt: its blocks are the same prefix, under the same salt."""
    url = start_router(api_keys=(KEY_A,), cache_salt_per_key=True)
    fakes["d0"].mode = "die_mid_stream"
    path, body = stream_request(False)
    with client.stream("POST", url + path, json=body, headers=_auth(KEY_A)) as resp:
        assert resp.status_code == 200
        text = b"".join(resp.iter_raw())
    assert b'"error"' not in text and text.endswith(b"data: [DONE]\n\n")
    moved = fakes["d1"].requests[0].body
    assert isinstance(moved["prompt"], list)  # a continuation, not the request again
    salts = {b.get("cache_salt") for b in _bodies(fakes)}
    assert len(salts) == 1 and None not in salts


def test_without_the_option_no_salt_is_sent(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    """Negative control: the same keys without --cache-salt-per-key: no body carries one,
    and a client's own salt passes unchanged."""
    url = start_router(api_keys=(KEY_A, KEY_B))
    assert _salts_of(KEY_A, url, client, fakes) == {None}
    assert _salts_of(KEY_B, url, client, fakes) == {None}
    assert _salts_of(KEY_A, url, client, fakes, {**BODY, "cache_salt": "mine"}) == {"mine"}


def test_without_keys_requests_stay_unsalted(
        fakes: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(cache_salt_per_key=True)
    resp = client.post(url + "/v1/completions", headers=_auth(KEY_A), json=BODY)
    assert resp.status_code == 200, resp.text
    assert {b.get("cache_salt") for b in _bodies(fakes)} == {None}
