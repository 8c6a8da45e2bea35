"""Settings for the whole suite."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings

from serve.vllm_cli import ENV_ENGINE_START, ENV_VLLM_ARGS

SUITE_VLLM_ARGS = "--enforce-eager --distributed-executor-backend uni"
"""How every vLLM server the suite starts runs (workers, plain references, chaos restarts,
autoscaled and Compose replicas; they inherit the variable): no torch.compile, the model inside
the engine core process. Measured here (tiny model, alone): ready in 22 s instead of 51-57 s,
the same greedy text, a 64-token completion no slower. vLLM's own CPU CI skips compilation too.
tests/e2e/test_pd_across_hosts.py keeps vLLM's default process layout (a separate worker
process) on its UCX wire. A PDSERVE_VLLM_ARGS already set wins."""
os.environ.setdefault(ENV_VLLM_ARGS, SUITE_VLLM_ARGS)
os.environ.setdefault(ENV_ENGINE_START, "fork")
"""And each engine core is forked from its API server instead of spawned (which imports vLLM a
second time): measured alone here, ready in 14-20 s instead of 31-33 s. Docker's replicas
(tests/e2e/test_compose.py) and tests/e2e/test_pd_across_hosts.py keep vLLM's spawn."""

# No per-example deadline: hypothesis' default (200 ms) is a wall-clock bar, and on a shared
# 2-core machine an example of test_pair_is_distinct_and_allowed took longer under load and
# failed the run. Property tests here assert behaviour, never speed.
settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")


_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: Any) -> None:
    """Collect every phase's duration (setup: the shared clusters start there) per module."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The suite's time budget per module (setup, call and teardown together), slowest first:
    where a shared cluster starts, its module carries the start."""
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.write_sep("=", f"time per module (total {total / 60:.1f} min)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
