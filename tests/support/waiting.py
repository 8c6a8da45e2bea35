"""Bounded polling for conditions that settle asynchronously (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(probe: Callable[[], T], check: Callable[[T], bool], timeout_s: float,
               interval_s: float = 0.2) -> T:
    """Poll ``probe`` until ``check`` accepts its value; returns it, or fails with the last."""
    deadline = time.monotonic() + timeout_s
    last = probe()
    while not check(last):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s; last value {last!r}")
        time.sleep(interval_s)
        last = probe()
    return last
