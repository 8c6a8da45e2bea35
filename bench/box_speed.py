"""How fast this machine is right now: memory copy bandwidth and the interpreter's loop speed.

    python -m bench.box_speed

The project's VM changes speed under us, and the load average does not see it. On 2026-11-30
one plain vLLM engine, alone (``pdserve bench profile``), decoded a step in 6.3 ms at 09:13,
18.3 ms at 15:48 and 9.2 ms at 16:13; a 256 MiB tensor copy, one thread, ran at 1.4 GB/s at
15:50 and 7.3 GB/s at 16:13, while a single-thread 1024 x 1024 matmul ran at 70-120 GFLOP/s
in the slow hour (near the core's peak).
The benchmarks print this probe beside their figures (``bench.pd_goodput`` before and after
each setup, ``bench.router_overhead`` before and after its run, ``pdserve bench profile`` in its
document), so a figure taken on a slow machine can be told from a slow change.

Two numbers, about half a second together, in the calling process on its allowed cores:
- ``copy_gbps``: bytes read plus written per second copying a 64 MiB float32 array into another
  (one thread, numpy), the median of five copies;
- ``loop_mops``: millions of iterations per second of a plain Python ``for`` loop adding
  integers, the median of five runs of 200,000 (the router and the engines' schedulers are
  Python).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

COPY_MIB = 64
"""Size of the array copied: well past any cache on the machines this runs on."""
REPEATS = 5
LOOP_N = 200_000


@dataclass(frozen=True)
class BoxSpeed:
    """One reading of the probe."""

    copy_gbps: float
    loop_mops: float

    def line(self) -> str:
        """``copy 5.1 GB/s, loop 31.2 M/s``: the form printed beside figures."""
        return f"copy {self.copy_gbps:.1f} GB/s, loop {self.loop_mops:.1f} M/s"

    def as_dict(self) -> dict[str, float]:
        """The reading as JSON-ready numbers."""
        return {k: round(v, 3) for k, v in asdict(self).items()}


def measure(timer: Callable[[], float] = time.perf_counter, copy_mib: int = COPY_MIB,
            repeats: int = REPEATS) -> BoxSpeed:
    """Read the probe now (``timer`` is the clock; tests pass their own)."""
    import numpy as np

    src = np.ones(copy_mib * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page of both before timing
    copies = []
    for _ in range(repeats):
        start = timer()
        np.copyto(dst, src)
        copies.append(timer() - start)
    loops = []
    for _ in range(repeats):
        start = timer()
        total = 0
        for i in range(LOOP_N):
            total += i
        loops.append(timer() - start)
    moved = 2 * src.nbytes
    return BoxSpeed(copy_gbps=moved / statistics.median(copies) / 1e9,
                    loop_mops=LOOP_N / statistics.median(loops) / 1e6)


def main() -> int:
    print(f"box: {measure().line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
