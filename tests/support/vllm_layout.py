"""Which vLLM processes run under a process: vLLM titles its engine processes (setproctitle)."""

from __future__ import annotations

from collections import Counter

import psutil

VLLM_TITLES = ("VLLM::EngineCore", "VLLM::Worker")


def vllm_processes(root_pid: int) -> Counter[str]:
    """How many of ``root_pid``'s descendants carry each vLLM process title."""
    counts: Counter[str] = Counter()
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for name in VLLM_TITLES:
            if title.startswith(name):
                counts[name] += 1
    return counts


def engine_cores(root_pid: int) -> list[psutil.Process]:
    """``root_pid``'s descendants titled ``VLLM::EngineCore``."""
    out = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith("VLLM::EngineCore"):
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def forked(proc: psutil.Process) -> bool:
    """Whether ``proc`` was forked from its parent rather than spawned: a forked child inherits
    its parent's open sockets, the API server's listening one among them; a spawned child is a
    new program that gets none. (Its environment and command line say nothing: vLLM's
    setproctitle writes over both.)"""
    def listening(p: psutil.Process) -> set[int]:
        return {c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    parents = listening(proc.parent())
    return bool(parents) and parents <= listening(proc)
