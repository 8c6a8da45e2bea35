"""A router restarted under ``pdserve up`` loses no connection: the supervisor keeps the
listening socket (serve.listener) and hands it to each router it starts (``--listen-fd``), so a
client that connects between two routers waits in the kernel's backlog and is answered by the
next one. Real router processes on a real Redis."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from serve.listener import listening_socket
from serve.process import child_setup
from serve.redis_server import RedisServer, free_port
from serve.worker import stop_process
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]


def _router(redis_url: str, port: int, fd: int | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "router.main", "--host", "127.0.0.1", "--port", str(port),
           "--redis-url", redis_url, *(["--listen-fd", str(fd)] if fd is not None else [])]
    return subprocess.Popen(cmd, cwd=ROOT, preexec_fn=child_setup(),
                            pass_fds=(fd,) if fd is not None else ())


def _version(url: str) -> int:
    try:
        return httpx.get(f"{url}/version", timeout=5, trust_env=False).status_code
    except httpx.TransportError:
        return 0


def test_a_client_connecting_between_two_routers_is_answered(redis_server: RedisServer) -> None:
    listener = listening_socket("127.0.0.1", free_port())
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    routers = [_router(redis_server.url, listener.getsockname()[1], listener.fileno())]
    try:
        eventually(lambda: _version(url), lambda status: status == 200, timeout_s=60)
        stop_process(routers[0])  # SIGTERM, as chaos' router_restart and a crash's exit
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: httpx.get(f"{url}/version", timeout=60,
                                                    trust_env=False).status_code)
            time.sleep(1.0)
            assert not pending.done()  # connected, waiting: nobody serves, nobody refused
            routers.append(_router(redis_server.url, listener.getsockname()[1],
                                   listener.fileno()))
            assert pending.result(timeout=60) == 200  # the next router answered it
    finally:
        for proc in routers:
            stop_process(proc)
        listener.close()


def test_control_a_router_that_binds_its_own_port_refuses_during_a_restart(
        redis_server: RedisServer) -> None:
    """Negative control: the same stop with the router owning its socket (no ``--listen-fd``,
    as before) refuses the client's connect."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = _router(redis_server.url, port)
    try:
        eventually(lambda: _version(url), lambda status: status == 200, timeout_s=60)
    finally:
        stop_process(router)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/version", timeout=5, trust_env=False)
