"""Plain vLLM workers behind the router: aggregated mode, mixed fleets, selective disaggregation.

The session's plain vLLM server (no connector) is registered as an ``aggregated`` worker: alone
in a Redis of its own behind a second router (aggregated mode), and beside the session cluster's
P/D pools in the cluster's Redis (a mixed fleet). A third router on the cluster's Redis runs
selective disaggregation. Every output must equal the plain server's own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtransfer.signing import Keyring
from router.state.registry import WorkerRecord, WorkerRegistry
from serve.redis_server import start_redis
from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.router import register
from tests.support.router_process import RouterProcess
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm


def _plain_record(plain: Plain, tiny_model_dir: Path) -> WorkerRecord:
    return WorkerRecord(worker_id=f"aggregated-{uuid.uuid4().hex[:6]}", role="aggregated",
                        model=SERVED_NAME, model_path=str(tiny_model_dir), http_url=plain.url,
                        engine_id="plain", ucx_address="", max_model_len=4096,
                        started_at=time.time())


@contextmanager
def _router(redis_url: str, *, keyring: Path | None = None, **settings: Any) -> Iterator[str]:
    """A second router process on ``redis_url`` (signing with ``keyring``, the cluster's
    secret, when it talks to the cluster's workers; ``settings`` as RouterSettings fields);
    yields its URL."""
    router = RouterProcess(redis_url=redis_url, **settings,
                           cluster_secret_file=None if keyring is None else str(keyring))
    router.start(timeout_s=60)
    try:
        yield router.url
    finally:
        router.stop()


@contextmanager
def _joined_as_aggregated(cluster: Cluster, plain: Plain, tiny_model_dir: Path
                          ) -> Iterator[WorkerRecord]:
    """The session's plain vLLM registered in the cluster's Redis as an aggregated worker
    (signed with the cluster's secret: its router takes no registration made without it); on
    exit deregistered, and gone from the router (the other tests expect the P/D pools alone)."""
    record = _plain_record(plain, tiny_model_dir).signed(
        Keyring.parse(cluster.keyring_file.read_text()))
    register(cluster.redis_url, [record], prefix="pdserve")
    try:
        yield record
    finally:
        async def leave() -> None:
            reg = WorkerRegistry(cluster.redis_url)
            try:
                await reg.deregister(record.worker_id)
            finally:
                await reg.close()

        asyncio.run(leave())
        eventually(lambda: httpx.get(f"{cluster.url}/health").json()["aggregated_workers"],
                   lambda n: n == 0, timeout_s=15)


def _reference(plain: Plain, prompt: str, max_tokens: int = 8) -> str:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{plain.url}/v1/completions", json=body, timeout=120).json()[
        "choices"][0]["text"]


def _paths(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {p: value(samples, "pdserve_router_paths_total", path=p)
            for p in ("pd", "pd_first_token", "decode_only", "aggregated")}


def test_aggregated_mode_serves_the_openai_sdk(plain: Plain, tiny_model_dir: Path) -> None:
    from openai import OpenAI

    redis = start_redis()
    try:
        register(redis.url, [_plain_record(plain, tiny_model_dir)], prefix="pdserve")
        with _router(redis.url) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            prompts = make_prompts(tiny_model_dir, [30, 400], seed=11, tag="aggregated")
            for prompt in prompts:
                ref = _reference(plain, prompt)
                out = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                                temperature=0)
                assert out.choices[0].text == ref
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True)
                    if c.choices)
                assert streamed == ref
            chat = client.chat.completions.create(
                model=SERVED_NAME, messages=[{"role": "user", "content": prompts[0]}],
                max_tokens=6, temperature=0)
            assert chat.choices[0].message.content
            assert _paths(url)["aggregated"] == 5
            assert httpx.get(f"{url}/health").json()["aggregated_workers"] == 1
    finally:
        redis.stop()


def test_mixed_fleet_routes_each_request_to_a_complete_path(
        cluster: Cluster, plain: Plain, tiny_model_dir: Path) -> None:
    with _joined_as_aggregated(cluster, plain, tiny_model_dir):
        eventually(lambda: httpx.get(f"{cluster.url}/health").json()["aggregated_workers"],
                   lambda n: n == 1, timeout_s=15)
        # while the router warms it with the session's earlier prompts, placement counts the
        # warm requests as its load and sends every request P/D (a CI run saw 12 of 12)
        eventually(lambda: value(scrape(cluster.url), "pdserve_router_warming_workers"),
                   lambda n: n == 0, timeout_s=120, interval_s=0.25)
        before = _paths(cluster.url)
        prompts = make_prompts(tiny_model_dir, [100 + 37 * i for i in range(12)], seed=12,
                               tag="mixed")
        for prompt in prompts:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            resp = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == _reference(plain, prompt)
        after = _paths(cluster.url)
        grew = {p: after[p] - before[p] for p in after}
        assert sum(grew.values()) == len(prompts)
        assert grew["aggregated"] >= 1 and grew["pd"] >= 1, grew  # both kinds of path used


def _hits(url: str) -> float:
    """Prompt tokens a vLLM engine found in its prefix cache so far."""
    return value(scrape(url), "vllm:prefix_cache_hits_total")


def test_a_worker_that_joins_is_warmed_with_the_prompts_it_would_take(
        cluster: Cluster, plain: Plain, tiny_model_dir: Path) -> None:
    """Warm before traffic (router.api.warm): prompts served by the cluster's prefill are
    sent to the plain vLLM when it joins as an aggregated worker (it is their spill target),
    so vLLM's own prefix-cache counters show them as hits there the first time they are asked
    of it; a prompt the router never saw is not (control)."""
    warm = make_prompts(tiny_model_dir, [600, 560, 520], seed=41, tag="warmed")
    (cold,) = make_prompts(tiny_model_dir, [600], seed=41, tag="never")
    for prompt in warm:  # served P/D: the router's cache model has them on the prefill
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        resp = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
    ok0 = value(scrape(cluster.url), "pdserve_router_warm_requests_total", role="aggregated",
                outcome="ok")
    with _joined_as_aggregated(cluster, plain, tiny_model_dir):
        # at least the three newest prompts: the plan goes newest first
        eventually(lambda: value(scrape(cluster.url), "pdserve_router_warm_requests_total",
                                 role="aggregated", outcome="ok") - ok0,
                   lambda n: n >= len(warm), timeout_s=120, interval_s=0.5)
        for prompt in [*warm, cold]:
            before = _hits(plain.url)
            _reference(plain, prompt, max_tokens=1)
            hit = _hits(plain.url) - before
            if prompt == cold:
                assert hit < 32, hit  # control: never seen, nothing to warm it with
            else:
                assert hit >= 448, hit  # 520-600 tokens: all full blocks but the last


def test_selective_disaggregation_skips_the_prefill_for_short_or_cached_prompts(
        cluster: Cluster, plain: Plain, workers: dict[str, str], tiny_model_dir: Path) -> None:
    short, long = make_prompts(tiny_model_dir, [20, 300], seed=13, tag="selective")
    follow_up = long + " and then some more words to ask"
    with _router(cluster.redis_url, keyring=cluster.keyring_file,
                 disagg_min_prefill_tokens=64) as url:
        pulls0 = value(scrape(workers["decode"]), "pdserve_kv_pulls_total")
        before = _paths(url)
        outputs = {}
        for name, prompt in (("short", short), ("long", long), ("follow_up", follow_up)):
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            outputs[name] = resp.json()["choices"][0]["text"]
            assert outputs[name] == _reference(plain, prompt), name
        after = _paths(url)
        assert after["decode_only"] - before["decode_only"] == 2  # short, and the follow-up
        assert after["pd"] - before["pd"] == 1  # the long prompt
        reasons = scrape(url)
        assert value(reasons, "pdserve_router_paths_total", path="decode_only",
                     reason="short_prompt") == 1
        assert value(reasons, "pdserve_router_paths_total", path="decode_only",
                     reason="cached_on_decode") == 1
        # only the long prompt's KV was pulled
        eventually(lambda: value(scrape(workers["decode"]), "pdserve_kv_pulls_total") - pulls0,
                   lambda n: n == 1, timeout_s=15)
