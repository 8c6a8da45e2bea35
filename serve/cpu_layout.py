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


def describe_affinity(pinned: tuple[int, ...], inherited: list[int] | tuple[int, ...],
                      online: int) -> str:
    """The cores a process runs on, as the log says it: ``cores 2,3`` when it pins itself,
    ``cores 1 (inherited)`` when its parent pinned it, ``all 4 cores`` when nobody did."""
    if pinned:
        return f"cores {cpu_list(pinned)}"
    if len(inherited) >= online:
        return f"all {online} cores"
    return f"cores {cpu_list(tuple(sorted(inherited)))} (inherited)"


def worker_cpus(spec: str, role: str, available: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Cores one worker pins itself to (empty = leave as is) from ``--cpus``:

    - ``all``: no pinning;
    - ``role``: prefill workers take the first half of ``available``, decode workers the second
      half, aggregated and flex workers all of them (deployments that cannot plan per replica, e.g.
      Docker Compose: prefill and decode then never share a core);
    - a list like ``0-3,8``: exactly those cores.
    """
    cores = sorted(available)
    if spec in ("", "all"):
        return ()
    if spec == "role":
        if role in ("aggregated", "flex") or len(cores) < 2:
            return ()
        half = len(cores) // 2
        return tuple(cores[:half]) if role == "prefill" else tuple(cores[half:])
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(
                f"--cpus must be all, role or a list like 0-3,8; got {spec!r}") from None
        if first > last:
            raise ValueError(f"--cpus range {part!r} is empty")
        out.update(range(first, last + 1))
    missing = out - set(cores)
    if missing:
        raise ValueError(f"--cpus names cores {sorted(missing)} this process may not use "
                         f"(allowed: {cpu_list(tuple(cores))})")
    return tuple(sorted(out))
