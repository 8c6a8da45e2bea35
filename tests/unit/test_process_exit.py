"""serve.process.exit_event: a launcher learns of its child's death when it happens, not at its
next heartbeat (the chaos run's kills waited up to a third of the heartbeat TTL before)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from serve.process import exit_event, first_of


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_event_is_set_when_the_child_is_killed_and_its_code_is_still_readable() -> None:
    proc = _sleeper()

    async def run() -> tuple[bool, bool, float]:
        with exit_event(proc) as exited:
            # negative control: a live child does not set it
            early = await first_of(exited, timeout_s=0.3)
            proc.send_signal(signal.SIGKILL)
            started = time.monotonic()
            late = await first_of(exited, timeout_s=30.0)
            return early, late, time.monotonic() - started

    try:
        early, late, waited = asyncio.run(run())
    finally:
        proc.kill()
    assert not early and late
    assert waited < 30.0  # woken by the exit, not by the timeout
    assert proc.poll() == -signal.SIGKILL  # the pidfd did not reap it: the code is there


def test_a_child_already_reaped_gives_an_event_that_is_never_set() -> None:
    proc = _sleeper()
    proc.kill()
    proc.wait()

    async def run() -> bool:
        with exit_event(proc) as exited:
            return await first_of(exited, timeout_s=0.2)

    assert asyncio.run(run()) is False


def test_first_of_says_which_came_first() -> None:
    async def run() -> tuple[bool, bool]:
        a, b = asyncio.Event(), asyncio.Event()
        none_set = await first_of(a, b, timeout_s=0.05)
        asyncio.get_running_loop().call_later(0.05, b.set)
        one_set = await first_of(a, b, timeout_s=30.0)
        return none_set, one_set

    assert asyncio.run(run()) == (False, True)
