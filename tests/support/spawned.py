"""A function run in a spawned process, driven over a pipe (an engine of its own in a test)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def spawned(target: Callable[[Any], None], start_s: float) -> Iterator[tuple[Any, Any]]:
    """Run ``target(conn)`` in a spawned process; yields (our end of the pipe, the first message
    it sends). On exit sends ``"stop"`` and joins it (killed after 10 s)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs,), daemon=True)
    proc.start()
    try:
        assert ours.poll(start_s), f"{target.__name__} did not start"
        yield ours, ours.recv()
    finally:
        ours.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
