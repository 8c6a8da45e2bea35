"""``bench.box_watch``: real samples of each allowed core, and the window a point keeps."""

from __future__ import annotations

import os
from pathlib import Path

from bench.box_watch import Sample, load, loop_on, read_jiffies, summarize, watch
from bench.pd_goodput import during_line


def test_watch_writes_a_sample_per_allowed_core_and_keeps_the_callers_cores(
        tmp_path: Path) -> None:
    """Each sample names a core this process may use, with a positive speed and a steal share
    in [0, 100]; sampling pins each loop to its core and then gives the cores back."""
    cores = os.sched_getaffinity(0)
    out = tmp_path / "w.jsonl"
    watch(out, interval_s=0.05, duration_s=0.3)
    samples = load(out)
    assert {s.core for s in samples} == cores
    assert all(s.cpu_mops > 0 and s.wait >= 0 and 0 <= s.steal_pct <= 100 for s in samples)
    assert len(samples) >= 2 * len(cores)
    assert os.sched_getaffinity(0) == cores
    cpu, wall = loop_on(min(cores), 1000)
    assert 0 < cpu <= wall + 1e-3
    assert os.sched_getaffinity(0) == cores


def test_steal_is_read_per_core_from_proc_stat() -> None:
    """Linux's /proc/stat has a steal column per core: one entry per online core, steal no
    more than all of that core's time."""
    jiffies = read_jiffies()
    assert set(jiffies) >= os.sched_getaffinity(0)
    assert all(0 <= steal <= total for steal, total in jiffies.values())


def _s(t: float, core: int, mops: float, steal: float = 0.0) -> Sample:
    return Sample(t=t, core=core, cpu_mops=mops, wait=0.0, steal_pct=steal)


def test_a_point_keeps_only_the_samples_taken_while_it_ran() -> None:
    """Medians per core of the samples inside the window; the slow samples just outside it
    (the negative control) change nothing."""
    samples = [_s(9.0, 0, 1.0), _s(10.0, 0, 20.0), _s(11.0, 0, 24.0), _s(12.0, 0, 22.0),
               _s(10.5, 1, 30.0, 5.0), _s(13.0, 1, 1.0, 90.0)]
    got = summarize(samples, 10.0, 12.0)
    assert got == {"0": {"samples": 3, "cpu_mops": 22.0, "wait": 0.0, "steal_pct": 0.0},
                   "1": {"samples": 1, "cpu_mops": 30.0, "wait": 0.0, "steal_pct": 5.0}}
    assert summarize(samples, 100.0, 200.0) == {}


def test_the_goodput_line_gives_each_cores_range_over_the_points() -> None:
    """The lowest and highest per-point median of each core, and the worst steal; nothing when
    no point was watched."""
    points = [{"box_during": summarize([_s(1, 0, 20.0), _s(1, 1, 25.0, 1.5)], 0, 2)},
              {"box_during": summarize([_s(1, 0, 28.0), _s(1, 1, 21.0)], 0, 2)}, {}]
    assert during_line(points) == ("core 0 20.0-28.0, core 1 21.0-25.0 M loops/s, "
                                   "steal <= 1.5 %")
    assert during_line([{}, {"box_during": {}}]) == ""
