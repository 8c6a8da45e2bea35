"""Router settings: defaults, env vars, CLI precedence, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import RouterSettings, load
from router.errors import ConfigError


def test_defaults() -> None:
    s = load([], env={})
    assert (s.host, s.port, s.redis_url, s.policy, s.log_level) == (
        "127.0.0.1", 8000, "redis://127.0.0.1:6379/0", "dualmap", "INFO")


def test_env_then_cli_precedence() -> None:
    env = {"PDSERVE_ROUTER_PORT": "9000", "PDSERVE_ROUTER_REDIS": "redis://h:1/2",
           "PDSERVE_ROUTER_LOG_LEVEL": "debug", "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": "3.5"}
    s = load([], env=env)
    assert (s.port, s.redis_url, s.log_level, s.prefill_timeout_s) == (
        9000, "redis://h:1/2", "DEBUG", 3.5)
    s = load(["--port", "9100", "--host", "0.0.0.0", "--policy", "least_loaded"], env=env)
    assert (s.port, s.host, s.policy, s.redis_url) == (9100, "0.0.0.0", "least_loaded",
                                                        "redis://h:1/2")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"policy": "magic"}, "allowed: aibrix_prefix, bounded_load_hash, consistent_hash, dualmap"),
    ({"decode_policy": "magic"}, "allowed"),
    ({"port": 0}, "port"),
    ({"log_level": "LOUD"}, "allowed: DEBUG"),
    ({"prefill_timeout_s": 0}, "prefill_timeout_s"),
    ({"decode_retries": -1}, "decode_retries"),
    ({"redis_url": "http://x"}, "redis://"),
    ({"header_timeout_s": -1}, "header_timeout_s"),
    ({"body_timeout_s": -0.5}, "body_timeout_s"),
    ({"max_connections": -1}, "max_connections"),
    ({"adaptive_window_s": 0}, "adaptive_window_s"),
])
def test_invalid_settings(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RouterSettings(**kwargs)  # type: ignore[arg-type]


def test_the_adaptive_window_reaches_the_path_decision() -> None:
    """``--adaptive-window-s`` (or its env var) is the split's decay constant; default 10 s."""
    from router.api.app import create_app
    from router.state.cluster import StaticCluster

    assert load([], env={}).adaptive_window_s == 10.0
    assert load([], env={"PDSERVE_ROUTER_ADAPTIVE_WINDOW_S": "4"}).adaptive_window_s == 4.0
    s = load(["--adaptive-window-s", "2.5"], env={"PDSERVE_ROUTER_ADAPTIVE_WINDOW_S": "4"})
    app = create_app(s, cluster=StaticCluster([]))
    assert app.state.router.adaptive.share_window_s == 2.5


def test_bad_env_value() -> None:
    with pytest.raises(ConfigError, match="PDSERVE_ROUTER_PORT"):
        load([], env={"PDSERVE_ROUTER_PORT": "eighty"})


def test_main_rejects_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    from router.main import main

    assert main(["--policy", "magic"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_a_short_cluster_secret_stops_the_router_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Review finding 22: a secret under 32 bytes (text or file) is a configuration error with
    the reason (exit status 2), not a traceback when the app is built; control: 32 bytes load."""
    with pytest.raises(ConfigError, match="cluster secret: the cluster secret is 20 bytes"):
        load([], env={"PDSERVE_CLUSTER_SECRET": "k" * 20})
    keyring = tmp_path / "keyring"
    keyring.write_text("k" * 31 + "\n")
    with pytest.raises(ConfigError, match="31 bytes; at least 32"):
        load([], env={"PDSERVE_CLUSTER_SECRET_FILE": str(keyring)})
    from router.main import main

    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET_FILE", str(keyring))
    assert main([]) == 2
    assert "at least 32 are required" in capsys.readouterr().err
    keyring.write_text("k" * 32 + "\n")
    assert load([], env={"PDSERVE_CLUSTER_SECRET_FILE": str(keyring)}).cluster_secret_file == \
        str(keyring)
