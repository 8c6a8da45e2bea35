"""`pdserve up` refuses a bad start before it starts anything, says why in one line, and leaves
nothing behind; the Redis it starts sits at `--redis-url` when that port is free.

The command runs as a real process (the console script). Every process it would start inherits
its environment, so a marker variable finds any process left behind in /proc.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from serve.redis_server import RedisServer, ensure_redis, free_port, redis_reachable, start_redis

PDSERVE = Path(sys.executable).with_name("pdserve")


def _marked(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _up(*args: str, log_root: Path | None = None, timeout_s: float = 60.0
        ) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run `pdserve up ARGS` to its end: (result, pids it left behind); its children's log
    directories go under ``log_root``."""
    marker = f"PDSERVE_TEST_MARKER={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    if log_root is not None:
        env["PDSERVE_LOG_ROOT"] = str(log_root)
    proc = subprocess.run([str(PDSERVE), "--log-level", "INFO", "up", *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)
    return proc, _marked(marker)


@pytest.fixture
def redis_port() -> Iterator[int]:
    """A free port for `--redis-url`: nothing may be listening on it after a refused start."""
    port = free_port()
    yield port
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "a Redis was left on --redis-url"


def _assert_refused(proc: subprocess.CompletedProcess[str], left: list[int], cause: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"pdserve up: {cause}", proc.stderr
    assert "Traceback" not in proc.stderr
    # nothing was started: no Redis, no worker, no router (each logs its start at INFO), and
    # no process of its environment is left (the control below shows both are seen)
    assert "started" not in proc.stderr and proc.stdout == "", proc.stderr
    assert left == []


def test_unknown_policy_is_refused_before_anything_starts(redis_port: int) -> None:
    proc, left = _up("--policy", "bogus", "--port", str(free_port()),
                              "--redis-url", f"redis://127.0.0.1:{redis_port}/0")
    _assert_refused(proc, left,
                    "unknown --policy 'bogus'; allowed: aibrix_prefix, bounded_load_hash, "
                    "consistent_hash, dualmap, dynamo_kv, least_loaded, llmd_default, "
                    "preble_e2, prefix_only, round_robin, sglang_cache_aware")


def test_unknown_decode_policy_from_the_env_is_refused(redis_port: int) -> None:
    os.environ["PDSERVE_DECODE_POLICY"] = "nope"
    try:
        proc, left = _up("--port", str(free_port()),
                                  "--redis-url", f"redis://127.0.0.1:{redis_port}/0")
    finally:
        del os.environ["PDSERVE_DECODE_POLICY"]
    _assert_refused(proc, left, "unknown --decode-policy 'nope'; allowed: kv_aware, "
                    "least_loaded, round_robin")


def test_busy_port_is_refused_before_anything_starts(redis_port: int) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, left = _up("--port", str(port),
                                  "--redis-url", f"redis://127.0.0.1:{redis_port}/0")
    _assert_refused(proc, left, f"port {port} on 127.0.0.1 is already in use; pick "
                    "another with --port (or PDSERVE_PORT)")


def test_missing_model_dir_is_refused(redis_port: int, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc, left = _up("--model", str(missing), "--port", str(free_port()),
                              "--redis-url", f"redis://127.0.0.1:{redis_port}/0")
    _assert_refused(proc, left, f"model '{missing}' is neither an existing path nor a "
                    "Hugging Face id (org/name); pass --model DIR, or leave it out for the tiny "
                    "model")


def test_a_child_dying_during_start_up_is_one_line_and_cleaned_up(tmp_path: Path) -> None:
    """Negative control of the checks above: this start gets past them (Redis and a worker
    start), then the router dies on a bad flag; the cause is one line, everything is stopped."""
    redis_port = free_port()
    proc, left = _up("--mode", "aggregated", "--port", str(free_port()),
                     "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                     "--router-arg=--no-such-router-flag", log_root=tmp_path, timeout_s=120)
    assert proc.returncode == 1, proc.stderr
    assert "started aggregated worker" in proc.stderr  # it did get past the pre-flight checks
    # the router wrote to its own log file; the end of it is shown above the cause
    (run,) = tmp_path.iterdir()
    router_log = run / "router.log"
    assert "unrecognized arguments: --no-such-router-flag" in router_log.read_text()
    lines = proc.stderr.splitlines()
    assert lines[-1] == ("pdserve up: router exited during start-up (exit code 2); the end "
                         f"of its log {router_log} is above"), proc.stderr
    assert any(line.startswith("  router| ") and "--no-such-router-flag" in line
               for line in lines[:-1]), proc.stderr
    assert "Traceback" not in proc.stderr
    assert left == []
    assert not redis_reachable(f"redis://127.0.0.1:{redis_port}/0")


# ---- where `pdserve up` finds or starts its Redis (serve.redis_server.ensure_redis) ----------

def test_redis_is_started_on_the_redis_url_port_when_free() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/3"
    server, used = ensure_redis(url)
    try:
        assert server is not None and server.port == port and used == url
        redis.Redis.from_url(used).set("k", "v")  # db 3 of the server we started
    finally:
        assert server is not None
        server.stop()


def test_an_answering_redis_is_used_not_replaced() -> None:
    existing = start_redis()
    try:
        server, used = ensure_redis(existing.url)
        assert server is None and used == existing.url
    finally:
        existing.stop()


def test_busy_redis_url_port_starts_elsewhere_and_says_where(
        caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:  # not a Redis: accepts, never answers PING
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        url = f"redis://127.0.0.1:{busy.getsockname()[1]}/2"
        server: RedisServer | None = None
        try:
            with caplog.at_level("WARNING", logger="serve.redis_server"):
                server, used = ensure_redis(url)
            assert server is not None and used == f"redis://127.0.0.1:{server.port}/2"
            assert redis_reachable(used)
            assert f"--redis-url {used}" in caplog.text and "port is taken" in caplog.text
        finally:
            if server is not None:
                server.stop()
