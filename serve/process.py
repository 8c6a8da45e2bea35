"""How supervised children are started: they die with their parent."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable


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
