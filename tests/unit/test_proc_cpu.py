"""bench.proc_cpu: CPU seconds by role from /proc, with real processes burning known CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bench.proc_cpu import CpuWatch, core_shares, read_proc
from bench.sim_fidelity import Point, measured_slowdown

# A "worker": it burns FRONTEND_S of its own CPU, starts a child that renames itself as vLLM's
# engine processes are named and burns ENGINE_S, then both wait to be killed (so /proc still
# shows them when the window closes). Burning is counted by the process's own CPU clock, so
# how busy the machine is changes how long it takes, not how much CPU it is.
_WORKER = textwrap.dedent("""
    import os, sys, time, subprocess
    def burn(s):
        end = time.process_time() + s
        while time.process_time() < end:
            pass
    if sys.argv[1] == "engine":
        open("/proc/self/comm", "w").write("VLLM::Worker")
        burn(float(sys.argv[2]))
        print("done", flush=True)
        time.sleep(600)
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], "engine", sys.argv[2]],
                             stdout=subprocess.PIPE, text=True)
    burn(float(sys.argv[1]))
    child.stdout.readline()
    print("done", flush=True)
    time.sleep(600)
""")
FRONTEND_S, ENGINE_S = 0.3, 0.6
TOLERANCE_S = 0.06
"""A few scheduler ticks (10 ms each) plus the interpreter's start-up, which counts too."""


@pytest.fixture
def worker() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(FRONTEND_S), str(ENGINE_S),
                             _WORKER], stdout=subprocess.PIPE, text=True)
    yield proc
    subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
    proc.kill()
    proc.wait()


@pytest.fixture
def idle() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time; print('ready', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # its start-up is over before any window opens
    yield proc
    proc.kill()
    proc.wait()


def test_splits_a_worker_into_engine_and_frontend(worker: subprocess.Popen[str],
                                                   idle: subprocess.Popen[str]) -> None:
    watch = CpuWatch({"w": worker.pid}, {"idle": idle.pid}, include_children=False)
    watch.start()
    assert worker.stdout is not None
    assert worker.stdout.readline().strip() == "done"
    record = watch.stop()
    used = record["workers"]["w"]
    # the engine child's burn lands in engine, the parent's in frontend, each once
    assert abs(used["engine_s"] - ENGINE_S) < TOLERANCE_S + 0.1, used
    assert FRONTEND_S - 0.02 <= used["frontend_s"] < FRONTEND_S + TOLERANCE_S + 0.15, used
    # negative control: a process that only sleeps spent (next to) nothing
    assert record["floating_s"]["idle"] < 0.02


def test_a_tree_is_counted_once_and_children_reaped_in_the_window_count_as_client(
        worker: subprocess.Popen[str]) -> None:
    import os

    watch = CpuWatch({"w": worker.pid}, {"bench": os.getpid()}, include_children=True)
    watch.start()
    subprocess.run([sys.executable, "-c",
                    "import time\nend = time.process_time() + 0.2\n"
                    "while time.process_time() < end: pass"], check=True)
    assert worker.stdout is not None
    worker.stdout.readline()
    record = watch.stop()
    floating = record["floating_s"]
    # the worker's tree is under this process too, and is not counted again in "bench"
    assert floating["bench"] < 0.2, floating
    assert floating["client"] >= 0.2, floating


def test_read_proc_names_this_process_and_none_for_a_gone_one(idle: subprocess.Popen[str]
                                                              ) -> None:
    info = read_proc(idle.pid)
    assert info is not None and info.ppid > 0 and info.cpu_s >= 0
    idle.kill()
    idle.wait()
    assert read_proc(idle.pid) is None


def test_core_shares_take_the_frontend_and_an_even_part_of_the_floating() -> None:
    record = {"wall_s": 10.0,
              "workers": {"a": {"cores": [0], "engine_s": 9.0, "frontend_s": 2.0},
                          "b": {"cores": [1], "engine_s": 5.0, "frontend_s": 0.0}},
              "floating_s": {"router": 3.0, "client": 1.0}}
    shares = core_shares(record)
    # a: 1 - (2 + 4 / 2) / 10; b: 1 - (0 + 2) / 10
    assert shares == pytest.approx({"a": 0.6, "b": 0.8})
    # control: nothing beside the engines leaves them their whole cores
    idle = {**record, "floating_s": {},
            "workers": {k: {**v, "frontend_s": 0.0} for k, v in record["workers"].items()}}
    assert core_shares(idle) == pytest.approx({"a": 1.0, "b": 1.0})


def test_measured_slowdown_is_the_inverse_share_and_needs_a_record() -> None:
    point = Point("t", 1.0, "round_robin", "round_robin", [], {}, (1.0, 0.05), core_share=0.8)
    assert measured_slowdown(point) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="no CPU record"):
        measured_slowdown(Point("t", 1.0, "round_robin", "round_robin", [], {}, (1.0, 0.05)))
