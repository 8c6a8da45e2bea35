"""Shared fixtures of the integration tests: a real Redis, fake workers, the real router."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from router.api.app import create_app
from router.config import RouterSettings
from serve.redis_server import RedisServer, start_redis
from tests.fakes.fake_worker import STUCK_SERVERS, FakeWorker, ServerThread, build_tiny_tokenizer
from tests.support.router import MAX_MODEL_LEN, PREFIX, register, wait_healthy


@pytest.fixture(scope="module", params=["default", "tcp"])
def ucx_tls(request: pytest.FixtureRequest) -> Iterator[str]:
    """UCX_TLS for the test process and the servers it spawns ("tcp": UCX's tcp transport
    only, RMA emulated in software), set before a module creates any UCX context."""
    old = os.environ.get("UCX_TLS")
    if request.param == "tcp":
        os.environ["UCX_TLS"] = "tcp"
    else:
        os.environ.pop("UCX_TLS", None)
    yield request.param
    if old is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = old


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def workers(redis_server: RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FakeWorker]]:
    """Fake prefill workers p0, p1 and decode workers d0, d1, registered under PREFIX."""
    tok = str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    fakes = {wid: FakeWorker(wid, role, model_path=tok, max_model_len=MAX_MODEL_LEN).start()
             for wid, role in [("p0", "prefill"), ("p1", "prefill"),
                               ("d0", "decode"), ("d1", "decode")]}
    register(redis_server.url, [f.record() for f in fakes.values()])
    yield fakes
    for fake in fakes.values():
        fake.stop()


@pytest.fixture
def fakes(workers: dict[str, FakeWorker]) -> dict[str, FakeWorker]:
    """The fake workers, reset to normal behaviour."""
    for fake in workers.values():
        fake.reset()
    return workers


@pytest.fixture
def start_router(redis_server: RedisServer) -> Iterator[Callable[..., str]]:
    """Starts real routers under uvicorn (settings overridable); stops them after the test."""
    servers: list[ServerThread] = []

    def start(redis_url: str | None = None, **overrides: Any) -> str:
        opts: dict[str, Any] = {"redis_url": redis_url or redis_server.url,
                                "redis_prefix": PREFIX, "refresh_interval_s": 0.1,
                                "prefill_timeout_s": 10.0, "decode_timeout_s": 10.0,
                                # these tests assert round-robin order; the default is dualmap
                                "policy": "round_robin"}
        opts.update(overrides)
        server = ServerThread(create_app(RouterSettings(**opts))).start()
        servers.append(server)
        wait_healthy(server.url)
        return server.url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=30.0) as c:
        yield c


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """In-process uvicorn servers whose shutdown hung (left running), with their tasks."""
    if STUCK_SERVERS:
        terminalreporter.section(f"{len(STUCK_SERVERS)} in-process servers did not shut down")
        for entry in STUCK_SERVERS:
            terminalreporter.write_line(entry[-4000:])
