"""How late the router's event loop runs what is due: the oversleep of a probe task.

Everything the router relays waits for its event loop. A callback that holds the loop (a
parse, a large JSON body, a synchronous call) holds every stream for as long, and no request
metric shows it by name. The probe sleeps ``interval_s`` again and again and reports by how
much each sleep ran over (``pdserve_router_event_loop_lag_seconds``). A parse of each
worker's whole ``/metrics`` once a second held the loop 10-14 ms per worker; this is where
such a thing shows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from router.state.cluster import cancel_task


class LoopLagProbe:
    """Observes, every ``interval_s``, how long past its due time a sleep ended."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._observe = observe
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    async def probe(self) -> float:
        """One sleep; observes and returns by how much it ran over (never negative)."""
        due = self._clock() + self.interval_s
        await self._sleep(self.interval_s)
        lag = max(0.0, self._clock() - due)
        self._observe(lag)
        return lag

    async def _loop(self) -> None:
        while True:
            await self.probe()

    def start(self) -> None:
        """Start probing in the background (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pdserve-loop-lag")

    async def close(self) -> None:
        await cancel_task(self._task)
        self._task = None
