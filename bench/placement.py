"""Where benchmark processes run: the cores each process tree may use (printed beside figures)."""

from __future__ import annotations

import os
import subprocess


def affinity(pid: int) -> str:
    """``pid``'s allowed cores, e.g. ``0,1`` (``?`` once it is gone)."""
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(pid)))
    except OSError:
        return "?"


def children(pid: int) -> dict[str, int]:
    """``comm[pid]`` -> pid of each direct child of ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    kids = [line.split(None, 1) for line in out.splitlines() if line.strip()]
    return {f"{comm.strip()}[{child}]": int(child) for child, comm in kids}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    kids = list(children(pid).values())
    return kids + [g for k in kids for g in descendants(k)]


def placement_of(named: dict[str, int]) -> dict[str, str]:
    """name -> the cores each process tree may run on (e.g. ``prefill: 0``)."""
    return {name: " | ".join(sorted({affinity(p) for p in [pid, *descendants(pid)]}))
            for name, pid in named.items()}
