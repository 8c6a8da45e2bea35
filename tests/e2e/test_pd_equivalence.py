"""Greedy outputs through the router (prefill -> KV pull -> decode) equal plain vLLM's.

The tests taking `pd_cluster` run on both KV transports (UCX and NIXL clusters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm

# 1 to ~1,500 tokens, crossing the CPU backend's 128-token block boundaries.
LENGTHS = [1, 2, 5, 9, 17, 33, 64, 100, 127, 128, 129, 200, 255, 257, 384, 511, 640, 800,
           1000, 1023, 1200, 1500]
MAX_TOKENS = 12


def complete(base: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(base: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(base: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """Concatenated text of an SSE stream and its usage chunk."""
    text, usage = [], None
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text), usage


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[str]:
    return make_prompts(tiny_model_dir, LENGTHS, seed=1)


def test_prompt_lengths_span_the_range(prompts: list[str], plain: Plain) -> None:
    lengths = [complete(plain.url, p, max_tokens=1)["usage"]["prompt_tokens"] for p in prompts]
    assert len(prompts) >= 20
    assert min(lengths) <= 2 and max(lengths) >= 1400


def test_completions_match_plain(pd_cluster: Cluster, plain: Plain, prompts: list[str]) -> None:
    for prompt in prompts:
        ours, ref = complete(pd_cluster.url, prompt), complete(plain.url, prompt)
        assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
        assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert ours["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]


def _paths(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {p: value(samples, "pdserve_router_paths_total", path=p)
            for p in ("pd", "pd_first_token")}


def test_completions_stream_match_plain(cluster: Cluster, plain: Plain,
                                        prompts: list[str]) -> None:
    """Streams take the first-token path (the prefill's token at once, the decode continuing
    from it) and still equal a plain server's output and usage."""
    before = _paths(cluster.url)
    streamed = prompts[::3]
    for prompt in streamed:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0}
        ours, ours_usage = stream(cluster.url, "/v1/completions", body)
        ref = complete(plain.url, prompt)
        assert ours == ref["choices"][0]["text"]
        assert ours_usage is not None
        assert ours_usage["completion_tokens"] == ref["usage"]["completion_tokens"]
        assert ours_usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    after = _paths(cluster.url)
    assert after["pd_first_token"] - before["pd_first_token"] == len(streamed)
    assert after["pd"] == before["pd"]


def test_first_token_inside_a_utf8_character_streams_classic(cluster: Cluster,
                                                             plain: Plain) -> None:
    """Regression found by `pdserve chaos`: this prompt's first sampled token is part of a
    UTF-8 character (the prefill answers text ""). Continuing from it made the decode stream
    the whole prompt text; the router must take classic P/D and match plain."""
    from serve.chaos.load import prompt_pool

    prompt = prompt_pool(24, 120, 7)[0]
    before = _paths(cluster.url)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    ours, _ = stream(cluster.url, "/v1/completions", body)
    assert ours == complete(plain.url, prompt)["choices"][0]["text"]
    after = _paths(cluster.url)
    assert after["pd"] - before["pd"] == 1
    assert after["pd_first_token"] == before["pd_first_token"]


def test_classic_pd_stream_for_requests_that_cannot_continue(cluster: Cluster, plain: Plain,
                                                             prompts: list[str]) -> None:
    """A stop string could span the first two tokens: such a stream takes classic P/D
    (the decode samples the first token itself) and equals plain too."""
    before = _paths(cluster.url)
    for prompt in prompts[1::6]:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "stop": ["never-appears-in-output"]}
        ours, _ = stream(cluster.url, "/v1/completions", body)
        ref = complete(plain.url, prompt, stop=["never-appears-in-output"])
        assert ours == ref["choices"][0]["text"]
    after = _paths(cluster.url)
    assert after["pd"] - before["pd"] == len(prompts[1::6])
    assert after["pd_first_token"] == before["pd_first_token"]


def test_chat_match_plain(cluster: Cluster, plain: Plain, prompts: list[str]) -> None:
    for prompt in prompts[1::3]:
        ours, ref = chat(cluster.url, prompt), chat(plain.url, prompt)
        assert ours["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_chat_stream_match_plain(cluster: Cluster, plain: Plain, prompts: list[str]) -> None:
    for prompt in prompts[2::3]:
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS, "temperature": 0}
        ours, usage = stream(cluster.url, "/v1/chat/completions", body)
        ref = chat(plain.url, prompt)
        assert ours == ref["choices"][0]["message"]["content"]
        assert usage is not None and usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_decode_pulls_instead_of_recomputing(pd_cluster: Cluster, plain: Plain,
                                             pd_workers: dict[str, str],
                                             tiny_model_dir: Path) -> None:
    cluster, workers = pd_cluster, pd_workers
    # Fresh prompts: a local prefix hit on decode would legitimately skip the pull.
    fresh = make_prompts(tiny_model_dir, [40, 300, 700, 1100], seed=2,
                         tag=f"pulltest-{cluster.transport}")
    d0, p0, r0 = scrape(workers["decode"]), scrape(workers["prefill"]), scrape(cluster.url)
    prompt_tokens = 0
    for prompt in fresh:
        ours, ref = complete(cluster.url, prompt), complete(plain.url, prompt)
        assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
        prompt_tokens += ours["usage"]["prompt_tokens"]
    d1 = scrape(workers["decode"])
    n = len(fresh)
    r1 = scrape(cluster.url)

    def routed(name: str, role: str) -> float:
        return value(r1, name, role=role) - value(r0, name, role=role)

    # One placement per request and role, plus one per retry: a pooled keep-alive connection
    # the worker closed as the router reused it is retried, on the same worker (a CI run once
    # counted 5 prefill placements for these 4 requests, every output still right).
    for role in ("prefill", "decode"):
        assert routed("pdserve_router_routing_decisions_total", role) == \
            n + routed("pdserve_router_upstream_retries_total", role), role

    def delta(name: str, **labels: str) -> float:
        return value(d1, name, **labels) - value(d0, name, **labels)

    assert delta("pdserve_kv_pulls_total") == n
    # UCX reads a same-host peer with process_vm_readv; NIXL has no such path of ours.
    same_host = n if cluster.transport == "ucx" else 0
    assert delta("pdserve_kv_pulls_same_host_total") == same_host
    assert delta("pdserve_kv_pull_failures_total") == 0
    assert delta("pdserve_kv_pulled_bytes_total") > 0
    # Decode computes at most the last prompt token of each request itself (to sample from it);
    # everything else came over the transfer.
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") <= n
    assert delta("vllm:prompt_tokens_by_source_total",
                 source="external_kv_transfer") >= prompt_tokens - n

    # The prefill worker freed every leased block once the pulls were released. A release
    # reaches the prefill's /metrics with its next engine step, after the decode answered.
    released = "pdserve_kv_leases_released_total"
    p1 = eventually(lambda: scrape(workers["prefill"]),
                    lambda s: value(s, released) - value(p0, released) >= n, timeout_s=60)
    assert value(p1, "pdserve_kv_leases_released_total") - \
        value(p0, "pdserve_kv_leases_released_total") == n
    expired = "pdserve_kv_leases_expired_total"
    assert value(p1, expired) == value(p0, expired)
    eventually(lambda: value(scrape(workers["prefill"]), "vllm:kv_cache_usage_perc"),
               lambda usage: usage == 0.0, timeout_s=15)


def test_a_client_priority_is_served_and_a_negative_one_refused(cluster: Cluster, plain: Plain,
                                                               prompts: list[str]) -> None:
    """pdserve's engines schedule by priority (the router's KV handoffs run at -1): a client's
    own priority of 0 or more is served through P/D (the prefill gets it, the decode the
    handoff's) with a plain server's output, streamed or not; a negative one is the router's,
    refused before any worker sees it."""
    before = _paths(cluster.url)
    prompt = prompts[-3]
    ref = complete(plain.url, prompt)["choices"][0]["text"]
    assert complete(cluster.url, prompt, priority=5)["choices"][0]["text"] == ref
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "priority": 5}
    assert stream(cluster.url, "/v1/completions", body)[0] == ref
    after = _paths(cluster.url)
    assert after["pd"] + after["pd_first_token"] - before["pd"] - before["pd_first_token"] == 2
    resp = httpx.post(f"{cluster.url}/v1/completions", json={**body, "priority": -1}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "priority"
