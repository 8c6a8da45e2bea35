"""Session fixtures: a real `pdserve up` cluster and a plain vLLM server on the tiny model.

Both start once per session (each vLLM start costs ~1 minute of a 2-core machine) and in
parallel, through tests/support/cluster.py. A second cluster on the NIXL transport starts only
for the tests parametrized over `pd_cluster` (equivalence, negative control, lease expiry and
late pull), which run last.
"""

from __future__ import annotations

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
TRANSPORTS = ("ucx", "nixl")
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


@pytest.fixture(scope="session")
def nixl_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Cluster]:
    """A second `pdserve up` whose workers use the NIXL transport (`--kv-transport nixl`).

    Started on first use; `pytest_collection_modifyitems` runs its tests last, so it idles
    beside the UCX cluster only for them."""
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("nixl-cluster"),
                         transport="nixl", lease_s=LEASE_S, instrument=True,
                         expect_workers=WORKERS) as cluster:
        yield cluster


@pytest.fixture(params=TRANSPORTS)
def pd_cluster(request: pytest.FixtureRequest) -> Cluster:
    """The P/D cluster of each KV transport, for the tests that must hold on both wires."""
    return request.getfixturevalue("cluster" if request.param == "ucx" else "nixl_cluster")


@pytest.fixture
def pd_workers(pd_cluster: Cluster) -> dict[str, str]:
    """role -> HTTP URL of ``pd_cluster``'s workers (from its Redis registry)."""
    return registered_workers(pd_cluster)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the NIXL cluster's tests last (stable order otherwise): its two workers then share
    the cores with the other clusters only while those tests run."""
    def on_nixl(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get("pd_cluster") == "nixl"

    items.sort(key=on_nixl)


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
