"""What the engines share their cores with: CPU seconds of a cluster's processes, by role.

A vLLM CPU engine's model runs in its ``VLLM::Worker`` process, scheduled by ``VLLM::EngineCore``:
those two are the engine (their time is what an idle profile measures). Everything else that
runs on an engine's core takes time from it: the engine's own API server (HTTP, tokenizing,
detokenizing every streamed token) and pdserve's worker wrapper, pinned beside it, and the
processes that float over every core (the router, the load generator, Redis). This module reads
``/proc`` (Linux) and classifies each process:

- ``engine``: ``VLLM::*`` processes (the model and its scheduler);
- ``frontend``: every other process under a worker (its API server, the pdserve wrapper);
- floating: anything else measured (named by the caller).

:class:`CpuWatch` takes a snapshot before and after a window and gives each worker's
``engine`` and ``frontend`` CPU seconds (by the cores the worker is pinned to) and each floating
process tree's, over the window's wall time (``python -m bench.routing_real`` records it per
point; ``python -m bench.sim_fidelity`` turns it into each engine's share of its core).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcInfo:
    """One process as ``/proc`` shows it."""

    pid: int
    ppid: int
    comm: str
    cpu_s: float
    """User + system CPU seconds so far (this process alone, not its children)."""


def read_proc(pid: int) -> ProcInfo | None:
    """``pid``'s :class:`ProcInfo` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return ProcInfo(pid, int(fields[1]), comm,
                    (int(fields[11]) + int(fields[12])) * _TICK_S)


def all_procs() -> dict[int, ProcInfo]:
    """Every process now, by pid."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := read_proc(int(name))) is not None:
            out[info.pid] = info
    return out


def tree(root: int, procs: Mapping[int, ProcInfo]) -> list[int]:
    """``root`` and every process below it in ``procs``."""
    kids: dict[int, list[int]] = {}
    for info in procs.values():
        kids.setdefault(info.ppid, []).append(info.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def role(info: ProcInfo) -> str:
    """``engine`` for vLLM's engine processes, else ``frontend`` (see the module doc)."""
    return "engine" if info.comm.startswith("VLLM::") else "frontend"


@dataclass
class CpuWatch:
    """CPU seconds of workers (by role) and of the processes beside them over one window.

    ``workers``: name -> the pid of each worker's top process (its tree is the worker);
    ``floating``: name -> the pid of a process tree whose CPU is counted as floating, less the
    workers' trees and the trees named before it (so a launcher can be named after what it
    launched, e.g. the benchmark itself last). Processes that start inside the window count
    from zero; those that end inside it are lost (their last time is not readable): keep the
    trees alive across the window. ``include_children`` adds the CPU of this process's children
    reaped inside the window (a load generator run to completion by ``subprocess.run``) as
    floating ``client``."""

    workers: Mapping[str, int]
    floating: Mapping[str, int] = field(default_factory=dict)
    include_children: bool = True
    _start: tuple[float, dict[int, ProcInfo], float] | None = None

    def start(self) -> None:
        """Take the window's first snapshot."""
        self._start = (time.monotonic(), all_procs(), _children_cpu_s())

    def stop(self) -> dict[str, Any]:
        """The window's record: ``wall_s``, per worker ``{"cores", "engine_s", "frontend_s"}``
        and per floating tree its CPU seconds."""
        if self._start is None:
            raise RuntimeError("CpuWatch.stop() before start()")
        t0, before, children0 = self._start
        now, wall = all_procs(), time.monotonic() - t0

        def spent(pid: int) -> float:
            old = before.get(pid)
            start_s = old.cpu_s if old is not None and old.comm == now[pid].comm else 0.0
            return max(0.0, now[pid].cpu_s - start_s)

        seen: set[int] = set()
        workers = {}
        for name, pid in self.workers.items():
            pids = tree(pid, now)
            seen.update(pids)
            workers[name] = {
                "cores": _cores(pid),
                "engine_s": round(sum(spent(p) for p in pids if role(now[p]) == "engine"), 3),
                "frontend_s": round(sum(spent(p) for p in pids if role(now[p]) != "engine"), 3)}
        floating = {}
        for name, pid in self.floating.items():
            pids = [p for p in tree(pid, now) if p not in seen]
            seen.update(pids)
            floating[name] = round(sum(spent(p) for p in pids), 3)
        if self.include_children:
            floating["client"] = round(_children_cpu_s() - children0, 3)
        return {"wall_s": round(wall, 3), "workers": workers, "floating_s": floating}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cores(pid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


def core_shares(record: Mapping[str, Any], cores: int | None = None) -> dict[str, float]:
    """Each worker's engine share of its core over the window (a :meth:`CpuWatch.stop`
    record): 1 minus the fraction of the worker's cores' time its frontend and its even part of
    the floating processes took (floating processes may run on any of ``cores`` cores, default:
    every worker's cores together). A worker with no pinned cores gets an even part of them."""
    wall = float(record["wall_s"])
    workers: Mapping[str, Mapping[str, Any]] = record["workers"]
    pinned = {c for w in workers.values() for c in w["cores"]}
    n = cores or len(pinned) or 1
    float_per_core = sum(record["floating_s"].values()) / n
    out = {}
    for name, w in workers.items():
        own = len(w["cores"]) or n / max(1, len(workers))
        taken = float(w["frontend_s"]) + float_per_core * own
        out[name] = max(0.05, 1.0 - taken / (wall * own)) if wall > 0 else 1.0
    return out
