"""Router replicas agree: DualMap sends a prompt to the same prefill worker from either one.

Two real router processes read one real Redis registry (four fake prefill workers, one fake
decode worker) and build their hash rings from it independently. Each prompt goes through both
routers (to the second in reverse order, so an arrival-order policy such as round robin would
disagree); the prefill worker that received it (by its ``x-request-id``) must be the same. The
pair of ring candidates is not visible from outside; the worker DualMap picks from it is.

Negative control: a third router on a registry with a different prefill set (p3 replaced by
p4) maps some prompts elsewhere, so agreement is not an artefact of, e.g., one worker taking
everything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from router.state.registry import WorkerRegistry
from serve.redis_server import RedisServer
from tests.fakes.fake_worker import FakeWorker, build_tiny_tokenizer
from tests.support.router_process import RouterProcess

PREFIX = "replicas"
OTHER_PREFIX = "replicas-other"
PREFILLS = ("p0", "p1", "p2", "p3")
OTHER_PREFILLS = ("p0", "p1", "p2", "p4")
N_PROMPTS = 40
# distinct from the first token on, longer than a few 16-token blocks, shorter than a 512-token
# key level: each prompt has its own routing key and none becomes a hot prefix
PROMPTS = [f"{i} says the quick brown fox jumps over the lazy dog, hello world number {i}; "
           f"prefill and decode run on separate workers ({i})" for i in range(N_PROMPTS)]


def _registry(url: str, prefix: str, call: Callable[[WorkerRegistry], object]) -> None:
    async def go() -> None:
        reg = WorkerRegistry(url, prefix=prefix, ttl_s=600)
        try:
            await call(reg)  # type: ignore[misc]
        finally:
            await reg.close()

    asyncio.run(go())


@pytest.fixture(scope="module")
def pool(redis_server: RedisServer,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FakeWorker]]:
    """p0..p4 and d0; {p0..p3, d0} registered under PREFIX, {p0, p1, p2, p4, d0} under
    OTHER_PREFIX."""
    tok = str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    workers = {wid: FakeWorker(wid, "prefill", model_path=tok).start()
               for wid in sorted({*PREFILLS, *OTHER_PREFILLS})}
    workers["d0"] = FakeWorker("d0", "decode", model_path=tok).start()
    sets = {PREFIX: (*PREFILLS, "d0"), OTHER_PREFIX: (*OTHER_PREFILLS, "d0")}
    for prefix, ids in sets.items():
        for wid in ids:
            _registry(redis_server.url, prefix,
                      lambda reg, wid=wid: reg.register(workers[wid].record()))
    yield workers
    for prefix, ids in sets.items():
        for wid in ids:
            _registry(redis_server.url, prefix, lambda reg, wid=wid: reg.deregister(wid))
    for fake in workers.values():
        fake.stop()


@pytest.fixture
def routers(redis_server: RedisServer) -> Iterator[Callable[[str], str]]:
    """Starts DualMap router processes on a registry prefix; stops them by handle."""
    started: list[RouterProcess] = []

    def start(prefix: str) -> str:
        proc = RouterProcess(redis_url=redis_server.url, redis_prefix=prefix,
                             refresh_interval_s=0.1, policy="dualmap",
                             prefill_timeout_s=30.0, decode_timeout_s=30.0)
        started.append(proc)
        return proc.start().url

    yield start
    for proc in started:
        proc.stop()


def _wait_members(client: httpx.Client, url: str, expected: set[str],
                  timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        data = client.get(url + "/workers").json()["data"]
        if {w["worker_id"] for w in data} == expected:
            return
        assert time.monotonic() < deadline, f"{url} never saw {sorted(expected)}: {data}"
        time.sleep(0.05)


def _placements(client: httpx.Client, url: str, tag: str, order: list[int],
                fakes: dict[str, FakeWorker]) -> dict[int, str]:
    """Prompt index -> the prefill worker that received it through the router at ``url``."""
    placed: dict[int, str] = {}
    for i in order:
        rid = f"{tag}-{i}"
        resp = client.post(url + "/v1/completions", headers={"x-request-id": rid},
                           json={"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == rid
        got = [wid for wid, f in fakes.items() if f.role == "prefill"
               and any(r.headers.get("x-request-id", "").startswith(rid + ".")
                       for r in f.requests)]
        assert len(got) == 1, f"{rid} reached prefill workers {got}"
        placed[i] = got[0]
    return placed


def test_two_router_replicas_place_every_prompt_on_the_same_prefill_worker(
        pool: dict[str, FakeWorker], routers: Callable[[str], str]) -> None:
    a, b = routers(PREFIX), routers(PREFIX)
    forward, backward = list(range(N_PROMPTS)), list(reversed(range(N_PROMPTS)))
    with httpx.Client(trust_env=False, timeout=60.0) as client:
        for url in (a, b):
            _wait_members(client, url, {*PREFILLS, "d0"})
        first_a = _placements(client, a, "a1", forward, pool)
        first_b = _placements(client, b, "b1", backward, pool)
        # again, each router now having seen every prompt once (its cache model says where)
        again_b = _placements(client, b, "b2", forward, pool)
        again_a = _placements(client, a, "a2", backward, pool)

        other = routers(OTHER_PREFIX)
        _wait_members(client, other, {*OTHER_PREFILLS, "d0"})
        elsewhere = _placements(client, other, "c1", forward, pool)

    assert first_a == first_b == again_a == again_b
    # not vacuous: the prompts spread over the pool ...
    assert len(set(first_a.values())) >= 3, first_a
    # ... and the mapping follows the membership: another prefill set moves some prompts
    assert set(elsewhere.values()) <= set(OTHER_PREFILLS)
    moved = [i for i in range(N_PROMPTS) if elsewhere[i] != first_a[i]]
    assert moved, "a different prefill set mapped every prompt the same way"
    # consistent hashing: prompts whose worker is in both sets mostly stay where they were
    kept = [i for i in range(N_PROMPTS) if first_a[i] != "p3" and elsewhere[i] == first_a[i]]
    assert kept, (first_a, elsewhere)
