"""Security review finding 17: a decode that dies between its release/renew request and the
prefill's reply, with the prefill under AddressSanitizer.

The prefill is a `tests.support.ucx_peer` "hold" process on a copy of `_ucxrma` built with
`-fsanitize=address` (libasan preloaded into its Python, reports written to files); the decode
is a "request" process. The decode sends two requests and is killed with SIGKILL before any
reply. The prefill then answers the first at once and the second once its first answer failed
(UCX saw the death), stays up, answers the next requester correctly and closes cleanly, and
ASAN reports nothing. Controls: libasan is mapped in the prefill, and the same ASAN set-up
reports the heap-use-after-free of a child that commits one.

What ASAN sees here: every access of the extension's own code (peers, transfers, queues, the
reply path) and every libc call of any library (memcpy, free, ...); it cannot see plain loads and
stores inside libucp, which is not instrumented. So the fix itself is what rules the old failure
out: replies go over an endpoint the prefill creates and owns, which UCX never frees behind its
back, instead of the reply endpoint UCX hands to the request's callback, which UCX frees once
it sees the requester fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kernels.native import build
from kvtransfer.transport import UcxEngine
from tests.support.ucx_peer import ROOT, Proc, start

ASAN_CFLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer")
DEADLINE_S = 30.0  # generous bound; never asserted as a duration


def _libasan() -> str | None:
    """The libasan gcc links against, or None when this gcc has none."""
    try:
        out = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libasan.so"],
                             capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return None
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@dataclass(frozen=True)
class Asan:
    """An instrumented build of the extension and the environment that runs it."""

    build_dir: Path
    libasan: str
    logs: Path

    def env(self, logs: Path | None = None) -> dict[str, str]:
        """Preload libasan and write reports under `logs` (default: this module's)."""
        # detect_leaks=0: CPython keeps memory until exit, which LeakSanitizer would report
        return {"LD_PRELOAD": self.libasan,
                "ASAN_OPTIONS": f"detect_leaks=0:log_path={logs or self.logs}/asan"}

    def reports(self) -> list[str]:
        """Every report ASAN wrote so far (one file per reporting process)."""
        return [p.read_text(errors="replace") for p in sorted(self.logs.glob("asan*"))]


@pytest.fixture(scope="module")
def tls(ucx_tls: str) -> str:
    """UCX_TLS for every process of the module (set before any UCX context exists)."""
    return ucx_tls


@pytest.fixture(scope="module")
def asan(tmp_path_factory: pytest.TempPathFactory) -> Asan:
    lib = _libasan()
    if lib is None:
        pytest.skip("gcc has no libasan.so (gcc -print-file-name=libasan.so): no instrumented "
                    "build possible here")
    out = build.build(install=build.resolve(), out_dir=tmp_path_factory.mktemp("asan-build"),
                      extra_cflags=ASAN_CFLAGS).parent
    return Asan(out, lib, tmp_path_factory.mktemp("asan-logs"))


@pytest.fixture
def prefill(tls: str, asan: Asan) -> Iterator[tuple[Proc, Any]]:
    proc = start(asan.build_dir, {"role": "hold"}, env=asan.env())
    try:
        coords = proc.ch.recv()
        yield proc, coords
    finally:
        proc.stop()


def _stats_until(proc: Proc, done: Any) -> dict[str, Any]:
    """The prefill's stats once `done(stats)` holds, or at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        proc.ch.send({"cmd": "stats"})
        stats: dict[str, Any] = proc.ch.recv()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _saw_the_death(stats: dict[str, Any]) -> bool:
    """UCX reported the requester's failure to the reply path: its endpoint failed, or a reply
    (or the endpoint it needed) could not be sent."""
    return bool(stats["reply_peers"][1] >= 1 or stats["failed_replies"] >= 1)


def test_a_requester_killed_before_the_reply_leaves_the_prefill_serving(
        prefill: tuple[Proc, Any], asan: Asan) -> None:
    proc, coords = prefill
    requests = [b"renew req-1 tok-1", b"release req-1 tok-1", b"release req-2 tok-2"]
    decode = start(None, {"role": "request", "server": coords, "payloads": requests})
    try:
        proc.ch.send({"cmd": "wait", "count": 3})
        assert proc.ch.recv() == requests
        proc.ch.send({"cmd": "reply", "count": 1})  # the decode is alive: our endpoint opens
        assert proc.ch.recv() == "replied"
        assert decode.ch.recv() == {"sent": 3, "first": b"re:" + requests[0]}
        os.kill(decode.popen.pid, signal.SIGKILL)  # two requests still unanswered
        assert decode.popen.wait(DEADLINE_S) == -signal.SIGKILL
    finally:
        decode.stop()

    proc.ch.send({"cmd": "reply", "count": 1})  # at once: UCX may not know of the death yet
    assert proc.ch.recv() == "replied"
    stats = _stats_until(proc, _saw_the_death)
    assert _saw_the_death(stats), stats
    proc.ch.send({"cmd": "reply"})  # once UCX saw it (old code: over the ep UCX freed then)
    assert proc.ch.recv() == "replied"
    stats = _stats_until(proc, lambda s: s["failed_replies"] >= 1)
    assert stats["failed_replies"] >= 1, stats  # nobody was there to answer
    assert stats["asan"], "libasan is not mapped in the prefill"

    # The next requester is answered, correctly.
    with UcxEngine(name="next-requester") as engine:
        transfer = engine.connect(coords[0]).request(b"renew req-3 tok-3")
        proc.ch.send({"cmd": "wait", "count": 1})
        assert proc.ch.recv() == [b"renew req-3 tok-3"]
        proc.ch.send({"cmd": "reply"})
        assert proc.ch.recv() == "replied"
        transfer.wait(DEADLINE_S)
        assert transfer.result() == b"re:renew req-3 tok-3"

    proc.ch.send("stop")
    assert proc.ch.recv() == "closed"
    assert proc.popen.wait(DEADLINE_S) == 0
    assert asan.reports() == []


USE_AFTER_FREE = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(64)
libc.free(p)
ctypes.string_at(p, 8)
"""


def test_control_the_asan_set_up_reports_a_use_after_free(asan: Asan, tmp_path: Path) -> None:
    """The reports above are read the way this finds one: same preload, same options."""
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, **asan.env(logs)}
    proc = subprocess.run([sys.executable, "-c", USE_AFTER_FREE], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    found = [p.read_text(errors="replace") for p in logs.glob("asan*")]
    assert len(found) == 1 and "heap-use-after-free" in found[0], (proc.stderr, found)
