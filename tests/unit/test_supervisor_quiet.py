"""`pdserve up` keeps vLLM's start-up chatter out of the terminal unless --log-level DEBUG."""

from __future__ import annotations

import pytest

from serve.cli import _parser
from serve.supervisor import QUIET_ENV, Cluster, settings_from_args


def _env(argv: list[str]) -> dict[str, str]:
    return Cluster(settings_from_args(_parser().parse_args(["up", *argv]))).env


def test_children_get_the_quiet_env_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*QUIET_ENV, "PDSERVE_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)
    env = _env([])
    assert env["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "ignore::FutureWarning" in env["PYTHONWARNINGS"]


def test_debug_keeps_everything_and_the_users_own_setting_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in QUIET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)
    env = _env(["--log-level", "DEBUG"])
    assert not set(QUIET_ENV) & set(env)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    assert _env([])["VLLM_LOGGING_LEVEL"] == "INFO"
