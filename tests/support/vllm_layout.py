"""Which vLLM processes run under a process: vLLM titles its engine processes (setproctitle)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import psutil

VLLM_TITLES = ("VLLM::EngineCore", "VLLM::Worker")


def _titled(root_pid: int) -> Iterator[tuple[psutil.Process, str]]:
    """``root_pid``'s descendants with their command lines (vLLM's titles), those still there."""
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            yield proc, " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def vllm_processes(root_pid: int) -> Counter[str]:
    """How many of ``root_pid``'s descendants carry each vLLM process title."""
    counts: Counter[str] = Counter()
    for _, title in _titled(root_pid):
        for name in VLLM_TITLES:
            if title.startswith(name):
                counts[name] += 1
    return counts


def engine_cores(root_pid: int) -> list[psutil.Process]:
    """``root_pid``'s descendants titled ``VLLM::EngineCore``."""
    return [proc for proc, title in _titled(root_pid) if title.startswith("VLLM::EngineCore")]


def forked(proc: psutil.Process) -> bool:
    """Whether ``proc`` was forked from its parent rather than spawned: a forked child keeps
    its parent's address-space layout, while a spawned one is a new program, laid out afresh
    by address-space randomisation (on here; were it off, the spawned negative control in
    tests/e2e/test_pd_across_hosts.py would fail, not pass). Its environment and command line
    say nothing: vLLM's setproctitle writes over both."""
    return _layout(proc.pid) == _layout(proc.parent().pid)


def _layout(pid: int) -> tuple[str, str]:
    """Start addresses of the process's first mapping (its executable) and of its heap."""
    with open(f"/proc/{pid}/maps") as maps:
        lines = maps.read().splitlines()
    heap = next((line.split("-")[0] for line in lines if line.endswith("[heap]")), "")
    return lines[0].split("-")[0], heap


def listening_ports(proc: psutil.Process) -> set[int]:
    """TCP ports ``proc`` listens on (in this network namespace)."""
    return {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
