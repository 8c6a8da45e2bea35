"""Session fixtures: a real `pdserve up` cluster and a plain vLLM server on the tiny model.

Both start once per session (each vLLM start costs ~1 minute of a 2-core machine) and in
parallel, through tests/support/cluster.py. The tests parametrized over `pd_cluster`
(equivalence, negative control, lease expiry and late pull) run last, grouped by transport: a
second cluster on the sealed tcp transport starts for its group, then is replaced by one on
NIXL for the last group (never three clusters at once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve.tiny_model import build_tiny_model
from tests.support.cluster import (
    Cluster,
    Plain,
    await_cluster,
    await_plain,
    launch_cluster,
    launch_plain,
    registered_workers,
    running_cluster,
    stop_cluster,
    stop_plain,
)

LEASE_S = 8.0
TRANSPORTS = ("ucx", "tcp", "nixl")
"""KV transports the `pd_cluster` tests hold on, in the order their groups run."""
WORKERS = 2
"""One prefill and one decode worker per session cluster; each must deregister on Ctrl-C."""


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_tiny_model()


@pytest.fixture(scope="session")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Cluster, Plain]]:
    plain = launch_plain(tiny_model_dir)
    # --kv-events: the router follows the prefill's KV cache events (tests/e2e/test_kv_events.py)
    cluster = launch_cluster(tiny_model_dir, tmp_path_factory.mktemp("cluster"), transport="ucx",
                             lease_s=LEASE_S, instrument=True, extra_args=("--kv-events",))
    try:
        await_plain(plain)
        await_cluster(cluster)
        yield cluster, plain
    finally:
        stop_plain(plain)
        stop_cluster(cluster, expect_workers=WORKERS)


class SecondCluster:
    """The session's cluster on another KV transport than the main one: started on first use,
    replaced (the old one stopped first) when tests ask for another transport."""

    def __init__(self, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._model_dir = model_dir
        self._tmp = tmp_path_factory
        self._stack = contextlib.ExitStack()
        self.transport: str | None = None
        self.cluster: Cluster | None = None

    def on(self, transport: str) -> Cluster:
        """A ready cluster whose workers use ``transport``."""
        if self.transport != transport or self.cluster is None:
            self.close()
            self.cluster = self._stack.enter_context(running_cluster(
                self._model_dir, self._tmp.mktemp(f"{transport}-cluster"), transport=transport,
                lease_s=LEASE_S, instrument=True, expect_workers=WORKERS))
            self.transport = transport
        return self.cluster

    def close(self) -> None:
        """Stop the running one, if any."""
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self.transport, self.cluster = None, None


@pytest.fixture(scope="session")
def second_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[SecondCluster]:
    clusters = SecondCluster(tiny_model_dir, tmp_path_factory)
    try:
        yield clusters
    finally:
        clusters.close()


@pytest.fixture(params=TRANSPORTS)
def pd_cluster(request: pytest.FixtureRequest) -> Cluster:
    """The P/D cluster of each KV transport, for the tests that must hold on every wire."""
    if request.param == "ucx":
        cluster: Cluster = request.getfixturevalue("cluster")
        return cluster
    second: SecondCluster = request.getfixturevalue("second_cluster")
    return second.on(request.param)


@pytest.fixture
def pd_workers(pd_cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of ``pd_cluster``'s workers (from its Redis registry)."""
    return registered_workers(pd_cluster)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the second clusters' tests last, grouped by transport (stable order otherwise):
    each second cluster then shares the cores with the others only while its group runs."""
    def group(item: pytest.Item) -> int:
        callspec = getattr(item, "callspec", None)
        transport = callspec.params.get("pd_cluster") if callspec is not None else None
        return TRANSPORTS.index(transport) if transport in TRANSPORTS[1:] else 0

    items.sort(key=group)


@pytest.fixture(scope="session")
def cluster(servers: tuple[Cluster, Plain]) -> Cluster:
    return servers[0]


@pytest.fixture(scope="session")
def plain(servers: tuple[Cluster, Plain]) -> Plain:
    return servers[1]


@pytest.fixture(scope="session")
def workers(cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of the UCX cluster's workers."""
    return registered_workers(cluster)
