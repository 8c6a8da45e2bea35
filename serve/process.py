"""How supervised children are started (they die with their parent) and watched."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any


def die_with_parent() -> None:
    """In a forked child: get SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``), so a
    launcher killed with -9 leaves no vLLM server holding its port and memory behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def child_setup(cpus: tuple[int, ...] = ()) -> Callable[[], None]:
    """``preexec_fn`` of a supervised child: die with the parent, run on ``cpus`` (if any)."""
    def setup() -> None:
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@contextlib.contextmanager
def exit_event(proc: subprocess.Popen[Any]) -> Iterator[asyncio.Event]:
    """An event the running loop sets the moment ``proc`` exits (Linux pidfd, which does not
    reap it: ``poll`` still gets its code), so a watcher learns of a crash at once instead of at
    its next poll. Where there is no pidfd, or ``proc`` is already gone, it is never set: keep
    polling beside it."""
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        yield exited
        return
    try:
        loop.add_reader(fd, exited.set)
        try:
            yield exited
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


async def first_of(*events: asyncio.Event, timeout_s: float) -> bool:
    """Wait until any of ``events`` is set or ``timeout_s`` passed; whether one was set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return bool(done)
