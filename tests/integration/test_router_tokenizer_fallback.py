"""A router host without the model's tokenizer still spreads prompts by prefix (real router,
real Redis, fake workers whose model path does not exist on this host)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import httpx
import pytest

from router.api.tokenization import approximate_ids
from router.policy.hashing import block_hashes
from router.state.registry import WorkerRegistry
from serve.redis_server import RedisServer
from tests.fakes.fake_worker import FakeWorker

PREFIX = "notokenizer"


@pytest.fixture
def untokenizable(redis_server: RedisServer) -> Iterator[dict[str, FakeWorker]]:
    fakes = {wid: FakeWorker(wid, role, model_path="/nonexistent/model").start()  # type: ignore[arg-type]
             for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))}

    async def reg(call: Callable[[WorkerRegistry], object]) -> None:
        registry = WorkerRegistry(redis_server.url, prefix=PREFIX, ttl_s=600)
        try:
            await call(registry)  # type: ignore[misc]
        finally:
            await registry.close()

    for f in fakes.values():
        asyncio.run(reg(lambda r, f=f: r.register(f.record())))
    yield fakes
    for wid, f in fakes.items():
        f.stop()
        asyncio.run(reg(lambda r, wid=wid: r.deregister(wid)))


def test_text_chunks_stand_in_for_tokens() -> None:
    a, b = approximate_ids("same prefix " * 40 + "tail A"), approximate_ids("same prefix " * 40)
    assert a[:100] == b[:100] and len(a) > len(b)
    # different prompts give different block hashes (the empty key was shared by all)
    assert block_hashes(approximate_ids("x" * 400)) != block_hashes(approximate_ids("y" * 400))
    assert block_hashes(()) == block_hashes(())


def test_prompts_spread_and_repeat_without_a_tokenizer(
        untokenizable: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client) -> None:
    url = start_router(redis_prefix=PREFIX, policy="dualmap")
    for i in range(16):
        prompt = f"document {i}: " + "lorem ipsum " * 30
        resp = client.post(url + "/v1/completions",
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    served = {wid: len(untokenizable[wid].requests) for wid in ("p0", "p1")}
    assert served["p0"] > 0 and served["p1"] > 0, served  # not all on one worker
    assert "pdserve_router_tokenizer_fallbacks_total 16.0" in client.get(url + "/metrics").text
    # a repeated prompt keeps its prefill worker (prefix affinity on the text)
    for worker in untokenizable.values():
        worker.requests.clear()
    for _ in range(4):
        client.post(url + "/v1/completions",
                    json={"model": "tiny", "prompt": "repeat me " * 50, "max_tokens": 2})
    assert sorted(len(untokenizable[w].requests) for w in ("p0", "p1")) == [0, 4]


def test_without_the_fallback_every_prompt_lands_on_one_worker(
        untokenizable: dict[str, FakeWorker], start_router: Callable[..., str],
        client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the spread above comes from the text fallback (the old behaviour
    put every untokenizable prompt on the same worker)."""
    import router.api.app

    monkeypatch.setattr(router.api.app, "approximate_ids", lambda text: ())
    url = start_router(redis_prefix=PREFIX, policy="dualmap")
    for i in range(16):
        client.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": f"document {i}: " + "lorem ipsum " * 30, "max_tokens": 2})
    assert sorted(len(untokenizable[w].requests) for w in ("p0", "p1")) == [0, 16]
