"""Real processes: `pdserve up --autoscale` grows the decode pool under load and shrinks it
back after the load stops, with no failed request and no leaked KV blocks; a stream queued on
the old decode when the new one joins moves to it (re-dispatch) and is answered there."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from router.autoscale.actuators import decisions_key
from router.errors import RegistryError
from router.state.registry import WorkerRegistry
from tests.support.autoscale_load import (
    AUTOSCALER_ARGS,
    PROFILE,
    QUEUED_LOAD_STREAMS,
    Trickle,
    sustained_load,
)
from tests.support.cluster import SERVED_NAME, running_cluster
from tests.support.metrics import scrape, value
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def autoscaled(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[str, str, Path]]:
    tmp = tmp_path_factory.mktemp("autoscale")
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    timeline = tmp / "router-timeline.jsonl"
    # one sequence per engine: of the load's streams, the decode runs one and queues the
    # others, so the new decode joins while requests wait on the old one
    args = ["--prefill", "1", "--decode", "2", "--autoscale",
            f"--autoscale-arg=--profile={profile}", "--worker-arg=--max-num-seqs=1",
            f"--router-arg=--timeline-file={timeline}",
            *(f"--autoscale-arg={arg}" for arg in AUTOSCALER_ARGS)]
    with running_cluster(tiny_model_dir, tmp, extra_args=args) as cluster:
        yield cluster.url, cluster.redis_url, timeline


def workers(redis_url: str, field: str = "http_url") -> dict[str, list[str]]:
    """Registered workers' URLs (or another record ``field``) by role; retried while the load
    streams keep this 2-core box so busy that Redis misses the registry's 1 s connect
    timeout."""
    for attempt in range(5):
        try:
            return _read_workers(redis_url, field)
        except RegistryError:
            if attempt == 4:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def _read_workers(redis_url: str, field: str) -> dict[str, list[str]]:
    async def read() -> dict[str, list[str]]:
        registry = WorkerRegistry(redis_url)
        try:
            out: dict[str, list[str]] = {"prefill": [], "decode": []}
            for r in await registry.list():
                out[r.role].append(getattr(r, field))
            return out
        finally:
            await registry.close()

    return asyncio.run(read())


def _decisions(redis_url: str) -> list[dict]:
    """The autoscaler's recorded decisions, oldest first."""
    raw = redis.Redis.from_url(redis_url).lrange(decisions_key("pdserve"), 0, -1)
    return [json.loads(d) for d in reversed(raw)]


def test_decode_pool_grows_under_load_and_shrinks_after(autoscaled: tuple[str, str, Path]
                                                        ) -> None:
    url, redis_url, timeline = autoscaled
    try:
        _grow_and_shrink(url, redis_url, timeline)
    except BaseException:
        # what the autoscaler decided, for the failure report: every size change, the last few
        decisions = _decisions(redis_url)
        for d in [d for d in decisions if d["desired"] != d["current"]] + decisions[-8:]:
            print(json.dumps(d))
        raise


def _grow_and_shrink(url: str, redis_url: str, timeline: Path) -> None:
    assert {k: len(v) for k, v in workers(redis_url).items()} == {"prefill": 1, "decode": 1}
    prefill_url = workers(redis_url)["prefill"][0]
    (old_decode,) = workers(redis_url, "worker_id")["decode"]
    moved_before = value(scrape(url), "pdserve_router_redispatches_total", role="decode")
    with sustained_load(url, SERVED_NAME, QUEUED_LOAD_STREAMS) as results:
        try:
            eventually(lambda: len(workers(redis_url)["decode"]), lambda n: n == 2,
                       timeout_s=400, interval_s=2)
            # Both decode workers serve while the load goes on.
            urls = workers(redis_url)["decode"]
            before = {u: value(scrape(u), "vllm:request_success_total") for u in urls}
            eventually(lambda: [value(scrape(u), "vllm:request_success_total") for u in urls],
                       lambda now: all(n > before[u] for u, n in zip(urls, now, strict=True)),
                       timeout_s=120, interval_s=2)
            # a stream queued on the old decode when the new one joined moved to it
            eventually(lambda: value(scrape(url), "pdserve_router_redispatches_total",
                                     role="decode") - moved_before,
                       lambda n: n >= 1, timeout_s=60, interval_s=1)
        finally:
            p0 = scrape(prefill_url)
    (new_decode,) = set(workers(redis_url, "worker_id")["decode"]) - {old_decode}

    # Load gone: after the cooldown the pool drains back to one worker; a trickle of requests
    # keeps flowing through the drain and every one of them succeeds ...
    trickle = Trickle(url, SERVED_NAME, lambda: len(workers(redis_url)["decode"]))
    load_ended = time.monotonic()
    trickle.until(1, timeout_s=360)
    print(f"autoscale e2e: back to one decode worker {time.monotonic() - load_ended:.0f} s "
          f"after the load ended ({len(trickle.results)} trickle requests)")
    trickle.hold(1)  # ... and it stays at one
    assert results and all(results), f"{results.count(False)} of {len(results)} failed"
    assert trickle.results and all(trickle.results), \
        f"{trickle.results.count(False)} of {len(trickle.results)} failed"
    # ... and every request succeeded, so the moved ones were answered by the new decode
    records = [json.loads(line) for line in timeline.read_text().splitlines()]
    moves = [(m["from"], m["to"]) for r in records for m in r.get("moves", ())
             if m["reason"] == "redispatch"]
    assert (old_decode, new_decode) in moves, moves

    # No leaked KV through the scale-down: every lease was released by a pull (none had to
    # expire), and the prefill worker holds no blocks at the end.
    p1 = scrape(prefill_url)
    expired = "pdserve_kv_leases_expired_total"
    assert value(p1, expired) == value(p0, expired)
    eventually(lambda: value(scrape(prefill_url), "vllm:kv_cache_usage_perc"),
               lambda usage: usage == 0.0, timeout_s=15)

    reasons = {(d["pool"], d["reason"]) for d in _decisions(redis_url)
               if d["desired"] != d["current"]}
    assert ("decode", "scale_up") in reasons and ("decode", "scale_down") in reasons
