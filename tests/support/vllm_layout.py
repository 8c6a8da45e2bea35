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
