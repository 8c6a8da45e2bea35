"""The arithmetic of ``python -m bench.router_overhead`` (pure: texts and numbers in, numbers out).

A *point* is one setup (``direct``, a router) at one target rate: its latency percentiles, and
for a router the latency it adds, its percentile minus the direct setup's percentile at the same
rate in the same run (a difference of percentiles, not a percentile of differences: the
requests are not paired). CPU figures come from ``/proc``: a process's ``utime + stime`` (all its
threads, exited ones included), in clock ticks.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.lean_client import Timing
from bench.metrics import percentile

PERCENTILES = (50, 90, 99)


def poisson_offsets(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """Send times of a Poisson arrival process at ``rate_rps`` over ``duration_s``."""
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate_rps)
    return out


def process_cpu_ticks(stat: str) -> int:
    """``utime + stime`` of a ``/proc/<pid>/stat`` line (the name in parentheses may hold
    spaces, so fields are counted after its closing parenthesis)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


PF_KTHREAD = 0x00200000
"""``flags`` bit of a kernel thread (proc(5)): its CPU is the kernel's, often our own traffic's
(softirq), not another process's."""


def user_processes_ticks(stats: Mapping[int, str], ignore: Iterable[int]) -> dict[int, int]:
    """``utime + stime`` of every user process in ``stats`` (pid -> its ``/proc/<pid>/stat``)
    but those in ``ignore``."""
    skip = set(ignore)
    out = {}
    for pid, stat in stats.items():
        fields = stat[stat.rindex(")") + 2:].split()
        if pid not in skip and not int(fields[6]) & PF_KTHREAD:
            out[pid] = int(fields[11]) + int(fields[12])
    return out


def others_ticks(before: Mapping[int, int], after: Mapping[int, int]) -> int:
    """CPU other processes spent between two :func:`user_processes_ticks` (one started since
    counts whole; one that ended since is lost)."""
    return sum(t - before.get(pid, 0) for pid, t in after.items())


@dataclass(frozen=True)
class Point:
    """One setup at one rate: what the client saw and what the processes spent."""

    setup: str
    rate_rps: float
    duration_s: float
    """The runs' summed wall time (their sends' spans)."""
    timings: tuple[Timing, ...]
    router_cpu_s: float | None
    """CPU the setup's router spent over its runs (None: no router)."""
    foreign_cpu_share: float
    """CPU other user processes (not the benchmark's, not kernel threads) took meanwhile, as a
    share of the machine's cores over the runs (0 = nobody else ran)."""
    load1: float
    """The 1-minute load average after the last run."""

    @property
    def ok(self) -> list[Timing]:
        return [t for t in self.timings if t.ok]

    @property
    def errors(self) -> int:
        return len(self.timings) - len(self.ok)

    @property
    def sent_rps(self) -> float:
        return len(self.timings) / self.duration_s if self.duration_s > 0 else 0.0

    def latency_ms(self, p: float) -> float:
        """Time to last byte, percentile ``p``, in ms (NaN without a completed request)."""
        return percentile([t.ttlb_s for t in self.ok], p, empty=float("nan")) * 1e3

    def ttft_ms(self, p: float) -> float:
        return percentile([t.ttft_s for t in self.ok], p, empty=float("nan")) * 1e3

    def lag_ms(self, p: float) -> float:
        """The client's send lag (it must stay far below the differences measured)."""
        return percentile([t.lag_s for t in self.timings], p, empty=float("nan")) * 1e3

    @property
    def router_cpu_ms_per_request(self) -> float | None:
        if self.router_cpu_s is None or not self.timings:
            return None
        return self.router_cpu_s * 1e3 / len(self.timings)


def added_ms(point: Point, direct: Point, p: float) -> float:
    """The latency ``point``'s router adds at percentile ``p``, ms (see the module docstring)."""
    return point.latency_ms(p) - direct.latency_ms(p)


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def table(points: Sequence[Point]) -> str:
    """The markdown table of every point, each router's added latency against the direct
    point at its rate."""
    direct: Mapping[float, Point] = {p.rate_rps: p for p in points if p.setup == "direct"}
    lines = ["| setup | rate req/s | sent req/s | p50 ms | p90 ms | p99 ms | TTFT p50 ms | "
             "added p50 ms | added p99 ms | router CPU ms/req | errors | send lag p99 ms | "
             "others' CPU | load1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pt in points:
        base = direct.get(pt.rate_rps)
        add = (None, None) if base is None or pt.setup == "direct" else \
            (added_ms(pt, base, 50), added_ms(pt, base, 99))
        lines.append(
            f"| {pt.setup} | {pt.rate_rps:g} | {pt.sent_rps:.1f} | {_f(pt.latency_ms(50))} | "
            f"{_f(pt.latency_ms(90))} | {_f(pt.latency_ms(99))} | {_f(pt.ttft_ms(50))} | "
            f"{_f(add[0])} | {_f(add[1])} | {_f(pt.router_cpu_ms_per_request, 3)} | "
            f"{pt.errors} | {_f(pt.lag_ms(99))} | {pt.foreign_cpu_share:.0%} | "
            f"{pt.load1:.2f} |")
    return "\n".join(lines)
