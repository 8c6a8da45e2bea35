"""cancel_task stops a background loop even when a cancellation is lost inside it (the router's
membership loop lost one in about one shutdown in five, and its shutdown then hung)."""

from __future__ import annotations

import asyncio

import pytest

from router.state.cluster import cancel_task


def _loses_first_cancellation(caught: list[int]) -> asyncio.Task[None]:
    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                caught.append(1)
                if len(caught) == 1:
                    continue  # swallowed, as a library call can
                raise

    return asyncio.create_task(loop())


def test_a_loop_that_loses_one_cancellation_still_stops() -> None:
    async def main() -> tuple[bool, int]:
        caught: list[int] = []
        task = _loses_first_cancellation(caught)
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_task(task), timeout=30)  # a hang guard, not a speed bar
        return task.cancelled(), len(caught)

    assert asyncio.run(main()) == (True, 2)


def test_one_cancellation_alone_leaves_such_a_loop_running() -> None:
    """Negative control: the single cancel + await it replaced would wait forever here."""
    async def main() -> bool:
        task = _loses_first_cancellation([])
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task}, timeout=0.3)
        running = not task.done()
        await cancel_task(task)
        return running

    assert asyncio.run(main())


def test_an_error_that_ended_the_loop_is_raised() -> None:
    async def main() -> None:
        async def fails() -> None:
            raise ValueError("boom")

        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_task(task)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(main())
