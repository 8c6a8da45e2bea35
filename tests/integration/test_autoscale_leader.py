"""The autoscalers' leader lock against a real Redis: one leader, atomic hand-over."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from router.autoscale.service import hold_leadership, leader_lock
from serve.redis_server import RedisServer


def test_one_leader_and_takeover_after_expiry(redis_server: RedisServer) -> None:
    async def go() -> None:
        a, b = (aioredis.from_url(redis_server.url) for _ in range(2))
        key = "leadertest:autoscaler:lock"
        lock_a, lock_b = leader_lock(a, key, 0.1), leader_lock(b, key, 0.1)
        try:
            assert await hold_leadership(lock_a)
            assert not await hold_leadership(lock_b)
            assert await hold_leadership(lock_a)  # renewed by its owner
            await asyncio.sleep(0.5)  # a stops renewing: the lock (0.3 s) expires
            assert await hold_leadership(lock_b)
            # The old leader's renewal fails although it still holds its token: the owner
            # check and the new TTL happen in one script, never on b's lock.
            assert not await hold_leadership(lock_a)
            assert await hold_leadership(lock_b)
            assert (await b.get(key)) == lock_b.local.token
        finally:
            await a.delete(key)
            await a.aclose()
            await b.aclose()

    asyncio.run(go())
