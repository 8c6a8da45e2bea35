"""The compose actuator on a real Docker engine, a real docker-compose project and a real Redis.

The project's ``decode`` service is a small HTTP server with vLLM's metric names (busy while
/tmp/busy exists in its container; it counts the scrapes in /tmp/scrapes): a real vLLM worker
needs ~50 s of this machine per start, and the actuator reads only ``/metrics``. docker-compose
itself then checks the clone is one of its replicas; the scale-down must drain before it
removes: the replica being removed is busy, and stays until the test makes it idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from router.autoscale.compose import ComposeActuatorConfig, DockerComposeActuator
from router.state.registry import WorkerRecord, WorkerRegistry
from serve.redis_server import RedisServer
from tests.support import compose as c

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

T = TypeVar("T")
PROJECT = "pdsactuatortest"
PREFIX = "composetest"
SERVER = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open('/tmp/scrapes', 'a') as f:
            f.write('.')
        busy = int(os.path.exists('/tmp/busy'))
        body = (f'vllm:num_requests_running{{model_name="m"}} {busy}\\n'
                'vllm:num_requests_waiting{model_name="m"} 0\\n'
                f'vllm:kv_cache_usage_perc{{model_name="m"}} {0.5 * busy}\\n').encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(('0.0.0.0', 8100), H).serve_forever()
"""


def compose_file(tmp: Path, image: str) -> Path:
    """A one-service project: ``decode`` runs SERVER (bind-mounted, as a clone gets it too)."""
    (tmp / "server.py").write_text(SERVER)
    path = tmp / "docker-compose.yml"
    path.write_text(f"services:\n  decode:\n    image: {image}\n    init: true\n"
                    f"    stop_grace_period: 2s\n    command: [python3, /server.py]\n"
                    f"    volumes: ['{tmp / 'server.py'}:/server.py:ro']\n")
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A running one-replica project; yields its compose command prefix."""
    if os.geteuid() != 0:
        pytest.skip("needs root: installs Debian's docker.io/docker-compose and starts dockerd")
    c.ensure_tools()
    c.ensure_engine()
    image = c.PDSERVE_IMAGE if c.image_exists(c.PDSERVE_IMAGE) else c.ensure_images().pdserve
    cmd = [*c.compose_cmd(), "-p", PROJECT, "-f",
           str(compose_file(tmp_path_factory.mktemp("compose"), image))]
    c.run([*cmd, "down", "-v", "--remove-orphans", "-t", "2"], timeout_s=120)
    c.run([*cmd, "up", "-d"], timeout_s=300)
    try:
        yield cmd
    finally:
        c.run([*cmd, "down", "-v", "--remove-orphans", "-t", "2"], timeout_s=120, check=False)


def in_container(cid: str, *args: str) -> str:
    return c.run([c.docker_cli(), "exec", cid, *args], timeout_s=60).stdout


def inspect_container(cid: str) -> dict[str, Any]:
    return dict(json.loads(c.run([c.docker_cli(), "inspect", cid], timeout_s=60).stdout)[0])


def ip_of(cid: str) -> str:
    (net,) = inspect_container(cid)["NetworkSettings"]["Networks"].values()
    return str(net["IPAddress"])


def compose_ids(cmd: list[str]) -> list[str]:
    """The service's containers as docker-compose itself sees them."""
    return c.run([*cmd, "ps", "-q", "decode"], timeout_s=60).stdout.split()


async def eventually_async(probe: Callable[[], T], done: Callable[[T], bool],
                           timeout_s: float) -> T:
    """``probe()`` (in a thread) until ``done`` holds for its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(probe)
        if done(value):
            return value
        assert time.monotonic() < deadline, f"not reached: {value!r}"
        await asyncio.sleep(0.5)


async def test_scale_up_clones_a_compose_replica_and_scale_down_drains_first(
        project: list[str], redis_server: RedisServer) -> None:
    actuator = DockerComposeActuator(ComposeActuatorConfig(
        redis_url=redis_server.url, prefix=PREFIX, project=PROJECT, drain_timeout_s=120,
        stop_timeout_s=2))
    (first,) = compose_ids(project)

    # Scale up: docker-compose sees the clone as its replica 2, DNS resolves the service to both.
    plan = await actuator.scale("decode", 2)
    assert plan.create == [(2, f"{PROJECT}_decode_2")]
    ids = compose_ids(project)
    assert len(ids) == 2 and first in ids
    (second,) = [i for i in ids if i != first]
    info = inspect_container(second)
    assert info["Name"] == f"/{PROJECT}_decode_2"
    assert info["Config"]["Labels"]["com.docker.compose.container-number"] == "2"
    assert info["Config"]["Hostname"] != inspect_container(first)["Config"]["Hostname"]
    ips = {ip_of(first), ip_of(second)}
    await eventually_async(
        lambda: set(in_container(first, "python3", "-c", "import socket; print(' '.join("
                                 "socket.gethostbyname_ex('decode')[2]))").split()),
        lambda got: got == ips, timeout_s=30)
    assert await actuator.scale("decode", 2) == type(plan)()  # steady: nothing to do

    # Replica 2 runs a worker that is busy; the registry knows it.
    worker_id = f"decode-{info['Config']['Hostname']}-0badc0de"
    registry = WorkerRegistry(redis_server.url, prefix=PREFIX, ttl_s=600)
    await registry.register(WorkerRecord(
        worker_id=worker_id, role="decode", model="m", model_path="/m",
        http_url=f"http://{ip_of(second)}:8100", engine_id="e", ucx_address="",
        max_model_len=128, started_at=time.time()))
    in_container(second, "touch", "/tmp/busy")
    in_container(second, "sh", "-c", ": > /tmp/scrapes")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)

    # Scale down to 0 asks for 1: replica 2 (the highest) leaves routing, is scraped busy
    # several times and is still there; only once idle is it removed.
    task = asyncio.create_task(actuator.scale("decode", 0))
    await eventually_async(lambda: len(in_container(second, "cat", "/tmp/scrapes")),
                           lambda n: n >= 3, timeout_s=60)
    assert r.smembers(f"{PREFIX}:draining") == {worker_id}
    assert not task.done() and inspect_container(second)["State"]["Running"]
    in_container(second, "rm", "/tmp/busy")
    plan = await asyncio.wait_for(task, timeout=120)
    assert [rep.number for rep in plan.remove] == [2]
    assert compose_ids(project) == [first]
    gone = subprocess.run([c.docker_cli(), "inspect", second], capture_output=True, timeout=60)
    assert gone.returncode != 0
    # deregistered: out of the registry and of the draining set
    assert worker_id not in {w.worker_id for w in await registry.list()}
    assert not r.smembers(f"{PREFIX}:draining")
    await registry.close()
    r.close()
