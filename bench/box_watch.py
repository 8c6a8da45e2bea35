"""What the machine did while a benchmark ran: core speed, waiting and steal, sampled.

    python -m bench.box_watch [--interval-s 2] [--out samples.jsonl] [--duration-s S]

``bench.box_speed`` reads the machine before and after a setup; between those readings its
Python loop speed moved by up to 1.6x within one invocation of ``bench.pd_goodput`` (17.4 to
28.6 M loops/s, 2026-12-01), and the same rate point's attainment moved by up to 0.1 between
runs. Whether the two go together needs the machine's speed *during* each point. This watcher
samples it cheaply enough to run beside the benchmark (about 1 ms of work per core every
``interval_s``) and writes one JSON line per sample and core:

- ``cpu_mops``: millions of loop iterations per second of the watcher's *own CPU time* on that
  core: the core's speed for Python code, meant to be blind to whoever else runs on it (core
  0 read 30.0-30.9 with a busy process on either core or both against 30.6 idle, 20 s each,
  2026-12-01; core 1 read 25.1 with both busy against 30.8 idle, which is load or drift);
- ``wait``: wall time over CPU time of the same loop, minus 1: how long it waited for the core
  once started (about 0.01 here whatever else runs: the scheduler runs a woken sampler at
  once, so this is not a load measure);
- ``steal_pct``: the share of that core's time the hypervisor gave to others since the last
  sample (``/proc/stat``'s steal column).

:func:`summarize` condenses the samples inside a time window (a rate point) into medians per
core; ``bench.pd_goodput`` joins them to its points.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.box_speed import python_loop

LOOP_N = 20_000
"""Iterations per sample: about 1 ms of one core at this box's 20-30 M loops/s."""


@dataclass(frozen=True)
class Sample:
    """One core's reading at one time."""

    t: float
    """Wall clock (``time.time``) when the sample ended."""
    core: int
    cpu_mops: float
    wait: float
    steal_pct: float

    def as_dict(self) -> dict[str, float]:
        """The sample as JSON-ready numbers."""
        return {k: round(v, 4) for k, v in asdict(self).items()}


def read_jiffies() -> dict[int, tuple[int, int]]:
    """Per core, (steal, all) jiffies from ``/proc/stat``: steal is its eighth column (empty
    where the file cannot be read)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if parts and parts[0].startswith("cpu") and parts[0] != "cpu" and len(parts) > 8:
            out[int(parts[0][3:])] = (int(parts[8]), sum(int(x) for x in parts[1:]))
    return out


def loop_on(core: int, n: int = LOOP_N) -> tuple[float, float]:
    """Run ``n`` loop iterations pinned to ``core``: (CPU seconds, wall seconds) they took.
    The caller's cores are given back afterwards."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        python_loop(n)
        return time.thread_time() - cpu0, time.perf_counter() - wall0
    finally:
        os.sched_setaffinity(0, allowed)


def sample_cores(cores: Sequence[int], before: dict[int, tuple[int, int]],
                 ) -> tuple[list[Sample], dict[int, tuple[int, int]]]:
    """One sample per core in ``cores``; ``before`` is the previous :func:`read_jiffies`."""
    loops = [(core, *loop_on(core)) for core in cores]
    now, jiffies = time.time(), read_jiffies()
    samples = []
    for core, cpu, wall in loops:
        stolen, spent = (a - b for a, b in zip(jiffies.get(core, (0, 0)),
                                               before.get(core, (0, 0)), strict=True))
        samples.append(Sample(t=now, core=core, cpu_mops=LOOP_N / max(cpu, 1e-9) / 1e6,
                              wait=max(wall / max(cpu, 1e-9) - 1.0, 0.0),
                              steal_pct=100.0 * stolen / spent if spent > 0 else 0.0))
    return samples, jiffies


def watch(out: Path, interval_s: float = 2.0, duration_s: float = 0.0) -> None:
    """Append samples of every allowed core to ``out`` every ``interval_s`` until killed (or
    for ``duration_s``, when positive)."""
    cores = sorted(os.sched_getaffinity(0))
    state = read_jiffies()
    end = time.monotonic() + duration_s if duration_s > 0 else float("inf")
    with out.open("a") as f:
        while time.monotonic() < end:
            time.sleep(interval_s)
            samples, state = sample_cores(cores, state)
            for s in samples:
                f.write(json.dumps(s.as_dict()) + "\n")
            f.flush()


def load(path: Path) -> list[Sample]:
    """The samples written to ``path``."""
    return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line]


def summarize(samples: Iterable[Sample], start: float, end: float) -> dict[str, Any]:
    """Medians per core of the samples taken in [``start``, ``end``] (wall clock): ``cpu_mops``,
    ``wait`` and ``steal_pct``, and how many samples each has."""
    by_core: dict[int, list[Sample]] = {}
    for s in samples:
        if start <= s.t <= end:
            by_core.setdefault(s.core, []).append(s)
    return {str(core): {"samples": len(ss),
                        "cpu_mops": round(statistics.median(s.cpu_mops for s in ss), 2),
                        "wait": round(statistics.median(s.wait for s in ss), 3),
                        "steal_pct": round(statistics.median(s.steal_pct for s in ss), 2)}
            for core, ss in sorted(by_core.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.box_watch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--duration-s", type=float, default=0.0, help="0 = until killed")
    parser.add_argument("--out", type=Path, default=Path("box-watch.jsonl"))
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        watch(args.out, args.interval_s, args.duration_s)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
