"""Requests held until the answers they would stall have ended (adaptive ``held`` plans).

A held plan (``router.policy.adaptive``, ``--hold-prefills``) names the requests whose answers
its prefill would push past the TPOT SLO. The router sends it once all of them have ended, not
after their predicted time: on a busy CPU box decode steps run longer than predicted, and a
prefill sent on the prediction landed under the last tokens it waited for. A deadline bounds
the wait (``router.policy.adaptive.hold_limit_s``).
"""

from __future__ import annotations

import asyncio
import time


class Holds:
    """One event per request id some held request waits for, set when that request ends."""

    def __init__(self) -> None:
        self._ended: dict[str, tuple[asyncio.Event, list[int]]] = {}
        """Request id -> (set when it ends, [held requests waiting for it])."""

    async def wait(self, request_ids: tuple[str, ...], timeout_s: float) -> float:
        """Wait until every one of ``request_ids`` has ended (:meth:`ended`), at most
        ``timeout_s``; the seconds waited. The ids must still be in flight when called (the
        adaptive decision takes them from its own in-flight state in the same step)."""
        if not request_ids or timeout_s <= 0:
            return 0.0
        start = time.monotonic()
        entries = [self._ended.setdefault(rid, (asyncio.Event(), [0])) for rid in request_ids]
        for _, waiters in entries:
            waiters[0] += 1
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e, _ in entries)), timeout_s)
        except TimeoutError:
            pass
        finally:
            for rid, (event, waiters) in zip(request_ids, entries, strict=True):
                waiters[0] -= 1
                if waiters[0] == 0 and self._ended.get(rid, (None,))[0] is event:
                    del self._ended[rid]  # nobody else waits for it
        return time.monotonic() - start

    def ended(self, request_id: str) -> None:
        """``request_id`` ended: whoever waits for it may go."""
        entry = self._ended.pop(request_id, None)
        if entry is not None:
            entry[0].set()

    def __len__(self) -> int:
        """Request ids some held request waits for now."""
        return len(self._ended)
