"""Three readings of this machine now: memory copy speed, Python loop speed, cross-core wake.

    python -m bench.box_speed [--json]

The project's VM changes speed under us, and the load average does not see it. On 2026-11-30
one plain vLLM engine, alone (``pdserve bench profile``), decoded a step in 6.3 ms at 09:13,
18.3 ms at 15:48 and 6.5 ms at 17:19. The benchmarks print this probe beside their figures
(``bench.pd_goodput`` before and after each setup, ``bench.router_overhead`` before and after
its run, ``pdserve bench profile`` in its document). It is a record of the machine, not a
verdict on it: it read a 1.4 GB/s copy in the slow hour, but the same 10 GB/s and 35-36 M
loops/s at 16:22 and at 17:19, while that engine prefilled at 166 and at 77 us per token.

Three numbers, about a second together, in the calling process on its allowed cores:
- ``copy_gbps``: bytes read plus written per second copying a 64 MiB float32 array into another
  (one thread, numpy), the median of five copies;
- ``loop_mops``: millions of iterations per second of a plain Python ``for`` loop adding
  integers, the median of five runs of 200,000 (the router and the engines' schedulers are
  Python);
- ``wake_us``: the round trip of one byte between two processes on two different cores over
  pipes, each side asleep until the other writes, the median of 2,000 (0 with one core). Every
  hop between the router, the client and an engine's processes pays it; on this VM it read
  84-88 us at 16:20 on 2026-11-30, where the same round trip on one core took 4 us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

COPY_MIB = 64
"""Size of the array copied: well past any cache on the machines this runs on."""
REPEATS = 5
LOOP_N = 200_000
WAKE_TRIPS = 2_000


@dataclass(frozen=True)
class BoxSpeed:
    """One reading of the probe."""

    copy_gbps: float
    loop_mops: float
    wake_us: float = 0.0

    def line(self) -> str:
        """``copy 5.1 GB/s, loop 31.2 M/s, wake 84 us``: the form printed beside figures."""
        return (f"copy {self.copy_gbps:.1f} GB/s, loop {self.loop_mops:.1f} M/s, "
                f"wake {self.wake_us:.0f} us")

    def as_dict(self) -> dict[str, float]:
        """The reading as JSON-ready numbers."""
        return {k: round(v, 3) for k, v in asdict(self).items()}


def python_loop(n: int) -> int:
    """``n`` iterations of a plain Python ``for`` loop adding integers (the unit of
    ``loop_mops`` here and in ``bench.box_watch``); their sum."""
    total = 0
    for i in range(n):
        total += i
    return total


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
        python_loop(LOOP_N)
        loops.append(timer() - start)
    moved = 2 * src.nbytes
    return BoxSpeed(copy_gbps=moved / statistics.median(copies) / 1e9,
                    loop_mops=LOOP_N / statistics.median(loops) / 1e6,
                    wake_us=wake_round_trip_us(timer))


def wake_round_trip_us(timer: Callable[[], float] = time.perf_counter,
                       trips: int = WAKE_TRIPS) -> float:
    """Median round trip, in us, of one byte to a child process on another allowed core and
    back over two pipes; 0.0 when this process may run on one core only."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return 0.0
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: echo each byte back, on the second core
        try:
            os.sched_setaffinity(0, {cores[1]})
            for _ in range(trips):
                os.read(down_r, 1)
                os.write(up_w, b"x")
        finally:
            os._exit(0)
    spans = []
    try:
        os.sched_setaffinity(0, {cores[0]})
        for _ in range(trips):
            start = timer()
            os.write(down_w, b"x")
            os.read(up_r, 1)
            spans.append(timer() - start)
    finally:
        os.sched_setaffinity(0, cores)
        os.waitpid(pid, 0)
        for fd in (down_r, down_w, up_r, up_w):
            os.close(fd)
    return statistics.median(spans) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.box_speed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the reading as JSON")
    args = parser.parse_args(argv)
    reading = measure()
    print(json.dumps(reading.as_dict()) if args.json else f"box: {reading.line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
