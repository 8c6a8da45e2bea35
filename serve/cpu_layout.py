"""Which cores each engine of a local cluster runs on.

vLLM's CPU workers busy-spin after every step and run OpenMP threads sized to the machine: two
engines left floating over the same cores steal each other's time slices, and a decode step
then waits behind a prefill (measured on 2 cores: ~700 ms of token stalls per P/D request
floating, 0 ms with one core each). So when the machine has at least one core per engine,
each engine gets its own contiguous share; otherwise all float and the plan says why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuPlan:
    """Core sets per engine slot (empty when engines float) and the reason."""

    slots: tuple[tuple[int, ...], ...]
    reason: str

    @property
    def isolated(self) -> bool:
        """True when every engine has cores of its own."""
        return bool(self.slots)


def plan_cpus(cores: list[int] | tuple[int, ...], engines: int, mode: str = "auto") -> CpuPlan:
    """Split ``cores`` into ``engines`` disjoint contiguous sets (``mode`` ``auto``), or let
    every engine float (``mode`` ``float``, or fewer cores than engines)."""
    if mode not in ("auto", "float"):
        raise ValueError(f"cpu layout must be auto or float, got {mode!r}")
    cores = sorted(cores)
    if mode == "float":
        return CpuPlan((), "floating over all cores (--cpu-layout float)")
    if engines < 1 or len(cores) < engines:
        return CpuPlan((), f"floating: {engines} engines on {len(cores)} cores "
                           "(fewer cores than engines)")
    share, extra = divmod(len(cores), engines)
    slots, start = [], 0
    for i in range(engines):
        n = share + (1 if i < extra else 0)
        slots.append(tuple(cores[start:start + n]))
        start += n
    return CpuPlan(tuple(slots), f"{engines} engines on {len(cores)} cores, one share each")


def cpu_list(cpus: tuple[int, ...]) -> str:
    """``taskset``/vLLM style list: ``0``, ``2,3``."""
    return ",".join(str(c) for c in cpus)
