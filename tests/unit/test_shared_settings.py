"""One name, env var and default per shared setting in every command (router.settings).

Each command's real parser is built and its real settings path run; a command that adds a
shared flag by hand (a divergent default) or stops reading the shared env var fails here.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from router import settings as shared
from router.errors import ConfigError

Extract = Callable[[list[str]], dict[str, Any]]


def _sub(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _router(argv: list[str]) -> dict[str, Any]:
    from router.config import load

    s = load(argv)
    return {name: getattr(s, name) for name in shared.COMMANDS["router"]}


def _up(argv: list[str]) -> dict[str, Any]:
    from serve.cli import _parser
    from serve.supervisor import settings_from_args

    args = _parser().parse_args(["up", *argv])
    s = settings_from_args(args)
    # the values the cluster itself uses must be the resolved ones too
    assert (s.redis_url, s.policy, s.lease_s, s.otlp_traces_endpoint) == (
        args.redis_url, args.policy, args.kv_lease_s, args.otlp_traces_endpoint)
    return {name: getattr(args, name) for name in shared.COMMANDS["up"]}


def _worker(argv: list[str]) -> dict[str, Any]:
    from serve.cli import _parser
    from serve.worker import settings_from_args

    args, extra = _parser().parse_known_args(["worker", "--role", "prefill", "--model", "m",
                                              "--insecure", *argv])
    s = settings_from_args(args, extra)
    return {"redis_url": s.redis_url, "log_level": args.log_level,
            "otlp_traces_endpoint": s.otlp_traces_endpoint, "kv_lease_s": s.lease_s,
            "kv_pull_timeout_s": s.pull_timeout_s}


def _autoscale(argv: list[str]) -> dict[str, Any]:
    from router.autoscale.service import settings_from_args
    from serve.cli import _parser

    args = _parser().parse_args(["autoscale", *argv])
    s = settings_from_args(args)
    return {"redis_url": s.redis_url, "log_level": args.log_level,
            "ttft_slo_s": s.planner.ttft_slo_s, "tpot_slo_s": s.planner.tpot_slo_s}


def _resolved_by(build: Callable[[], argparse.ArgumentParser], command: str,
                 prefix: list[str]) -> Extract:
    def extract(argv: list[str]) -> dict[str, Any]:
        args = build().parse_args([*prefix, *argv])
        shared.resolve_into(args, command)
        return {name: getattr(args, name) for name in shared.COMMANDS[command]}

    return extract


def _status_parser() -> argparse.ArgumentParser:
    from router.autoscale.decisions import status_parser

    return status_parser()


def _drain_parser() -> argparse.ArgumentParser:
    from router.autoscale.drain import parser

    return parser()


def _bench_parser() -> argparse.ArgumentParser:
    from bench.cli import build_parser

    return build_parser()


def _chaos_parser() -> argparse.ArgumentParser:
    from serve.chaos.runner import parser

    return parser()


def _sim_parser() -> argparse.ArgumentParser:
    from bench.sim.cli import _parser

    return _parser()


EXTRACT: dict[str, Extract] = {
    "router": _router,
    "up": _up,
    "worker": _worker,
    "autoscale": _autoscale,
    "autoscale status": _resolved_by(_status_parser, "autoscale status", []),
    "drain": _resolved_by(_drain_parser, "drain", ["ready"]),
    "bench": _resolved_by(_bench_parser, "bench",
                          ["replay", "--url", "u", "--trace", "t", "--out", "o"]),
    "sim": _resolved_by(_sim_parser, "sim", ["--trace", "t", "--prefill", "1", "--decode", "1",
                                             "--policies", "dualmap", "--out", "o"]),
    "chaos": _resolved_by(_chaos_parser, "chaos", []),
}


def _parsers() -> dict[str, list[argparse.ArgumentParser]]:
    """Every parser a command's shared flags live in (the real ones, built fresh)."""
    from router.config import _parser as router_parser
    from serve.cli import _parser as top

    cli = top()
    bench = _bench_parser()
    return {
        "router": [router_parser()],
        "up": [_sub(cli, "up")],
        "worker": [_sub(cli, "worker")],
        "autoscale": [_sub(cli, "autoscale")],
        "autoscale status": [_status_parser()],
        "drain": [_drain_parser()],
        "bench": [_sub(bench, "replay"), _sub(bench, "sweep")],
        "sim": [_sim_parser()],
        "chaos": [_chaos_parser()],
    }


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for var in list(os.environ):
        if var.startswith("PDSERVE_"):
            monkeypatch.delenv(var)
    yield


# a value unlike every default, per setting (as env text, and as parsed)
SAMPLES: dict[str, tuple[str, Any]] = {
    "redis_url": ("redis://elsewhere:6390/3", "redis://elsewhere:6390/3"),
    "log_level": ("warning", "WARNING"),
    "ttft_slo_s": ("2.5", 2.5),
    "tpot_slo_s": ("0.25", 0.25),
    "policy": ("least_loaded", "least_loaded"),
    "decode_policy": ("kv_aware", "kv_aware"),
    "prefill_s_per_token": ("0.002", 0.002),
    "max_in_flight_per_worker": ("7", 7),
    "admission_queue_slo_factor": ("3.5", 3.5),
    "request_timeout_s": ("9", 9.0),
    "max_concurrent_per_key": ("4", 4),
    "answer_deadline_s": ("600", 600.0),
    "prefill_tokens_per_min_per_key": ("90000", 90000),
    "decode_tokens_per_min_per_key": ("30000", 30000),
    "max_body_bytes": ("4096", 4096),
    "header_timeout_s": ("2.5", 2.5),
    "body_timeout_s": ("45", 45.0),
    "max_connections": ("512", 512),
    "max_prompt_tokens": ("300", 300),
    "max_output_tokens": ("40", 40),
    "otlp_traces_endpoint": ("http://otel:4317", "http://otel:4317"),
    "kv_lease_s": ("12", 12.0),
    "kv_pull_timeout_s": ("4", 4.0),
}


def test_tables_are_complete() -> None:
    assert set(SAMPLES) == set(shared.SETTINGS)
    assert set(EXTRACT) == set(shared.COMMANDS) == set(_parsers())
    for command, names in shared.COMMANDS.items():
        assert set(names) <= set(shared.SETTINGS), command
    for (command, name) in shared.OVERRIDES:
        assert name in shared.COMMANDS[command]


HOMONYMS = {
    ("bench", "--max-output-tokens"): "clamps the replayed trace's response lengths; the "
                                      "router's limit of the same name answers 400",
}
"""A flag spelled like a shared setting that means something else in that command."""


@pytest.mark.parametrize("command", sorted(shared.COMMANDS))
def test_every_command_exposes_the_canonical_flag(command: str) -> None:
    """Each of the command's settings is there under its one flag, added by the shared
    helper (the env var and default are then resolved in one place); no parser adds a shared
    flag, or an old spelling of one, by hand with its own default."""
    spellings = {f: s for s in shared.SETTINGS.values() for f in (s.flag, *s.deprecated_flags)}
    for parser in _parsers()[command]:
        by_flag = {opt: a for a in parser._actions for opt in a.option_strings}
        for name in shared.COMMANDS[command]:
            s = shared.SETTINGS[name]
            for flag in (s.flag, *s.deprecated_flags):
                assert flag in by_flag, f"{command} lacks {flag}"
                assert by_flag[flag].dest == name
        for flag, action in by_flag.items():
            if flag in spellings and (command, flag) not in HOMONYMS:
                assert action.default is argparse.SUPPRESS, (
                    f"{command} adds {flag} with its own default {action.default!r}; "
                    f"use router.settings.add_arguments")
                assert spellings[flag].name in shared.COMMANDS[command], (command, flag)


@pytest.mark.parametrize("command", sorted(shared.COMMANDS))
def test_same_default_env_and_flag_everywhere(command: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    extract = EXTRACT[command]
    names = shared.COMMANDS[command]
    assert extract([]) == {n: shared.default(n, command) for n in names}
    for name in names:
        text, value = SAMPLES[name]
        monkeypatch.setenv(shared.SETTINGS[name].env, text)
    assert extract([]) == {n: SAMPLES[n][1] for n in names}
    # a flag beats the env var
    flags = [f"{shared.SETTINGS[n].flag}={SAMPLES[n][0]}" for n in names]
    for name in names:
        monkeypatch.setenv(shared.SETTINGS[name].env, "bogus-if-read")
    assert extract(flags) == {n: SAMPLES[n][1] for n in names}


def test_overrides_are_the_only_per_command_defaults() -> None:
    assert shared.OVERRIDES == {("worker", "redis_url"): None,
                                ("drain", "redis_url"): "redis://pdserve-redis:6379/0",
                                ("chaos", "kv_lease_s"): 10.0}


def test_typed_defaults_agree_with_the_table() -> None:
    """The components' own dataclass defaults (used when built without a CLI) are the same."""
    from kvtransfer.config import ConnectorConfig
    from router.autoscale.planner import PlannerConfig
    from router.config import RouterSettings
    from serve.supervisor import ClusterSettings
    from serve.worker import WorkerSettings

    router = RouterSettings()
    for name in shared.COMMANDS["router"]:
        assert getattr(router, name) == shared.default(name), name
    planner, connector = PlannerConfig(), ConnectorConfig()
    assert (planner.ttft_slo_s, planner.tpot_slo_s) == (shared.default("ttft_slo_s"),
                                                        shared.default("tpot_slo_s"))
    assert (connector.lease_s, connector.pull_timeout_s) == (
        shared.default("kv_lease_s"), shared.default("kv_pull_timeout_s"))
    worker = WorkerSettings(role="prefill", model="m")
    assert (worker.lease_s, worker.pull_timeout_s) == (connector.lease_s,
                                                       connector.pull_timeout_s)
    cluster = ClusterSettings()
    assert (cluster.redis_url, cluster.policy, cluster.lease_s) == (
        shared.default("redis_url"), shared.default("policy"), shared.default("kv_lease_s"))


def test_ttft_slo_is_one_value_for_router_and_autoscaler() -> None:
    """The filed bug: 5 s in the router, 1 s in the autoscaler `pdserve up --autoscale` runs."""
    assert _router([])["ttft_slo_s"] == _autoscale([])["ttft_slo_s"] == _up([])["ttft_slo_s"]


# ---- deprecated spellings ---------------------------------------------------------------

DEPRECATED_FLAGS = [(cmd, old, name) for name, s in shared.SETTINGS.items()
                    for old in s.deprecated_flags for cmd in shared.used_by(name)]


@pytest.mark.parametrize(("command", "old", "name"), DEPRECATED_FLAGS)
def test_deprecated_flags_still_work_and_warn(command: str, old: str, name: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    text, value = SAMPLES[name]
    with caplog.at_level(logging.WARNING, logger="router.settings"):
        got = EXTRACT[command]([old, text])
    assert got[name] == value
    assert f"{old} is deprecated; use {shared.SETTINGS[name].flag}" in caplog.text


DEPRECATED_ENVS = [(name, old) for name, s in shared.SETTINGS.items()
                   for old in s.deprecated_envs]


@pytest.mark.parametrize(("name", "old"), DEPRECATED_ENVS)
def test_deprecated_env_vars_still_work_and_warn(name: str, old: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    text, value = SAMPLES[name]
    command = shared.used_by(name)[0]
    with caplog.at_level(logging.WARNING, logger="router.settings"):
        r = shared.resolve(None, command, {old: text}, names=(name,))[name]
    assert (r.value, r.source) == (value, f"env {old} (deprecated)")
    assert f"{old} is deprecated; use {shared.SETTINGS[name].env}" in caplog.text
    # the canonical name wins when both are set, without a warning
    caplog.clear()
    both = {old: text, shared.SETTINGS[name].env: text}
    canonical = shared.resolve(None, command, both, names=(name,))[name]
    assert canonical.source == f"env {shared.SETTINGS[name].env}"
    assert "deprecated" not in caplog.text


def test_deprecated_env_names_used_by_deploy_files_still_reach_the_router(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docker-compose.yml and k8s/base/router.yaml set PDSERVE_ROUTER_POLICY and
    PDSERVE_ROUTER_LOG_LEVEL."""
    monkeypatch.setenv("PDSERVE_ROUTER_POLICY", "round_robin")
    monkeypatch.setenv("PDSERVE_ROUTER_LOG_LEVEL", "debug")
    got = _router([])
    assert (got["policy"], got["log_level"]) == ("round_robin", "DEBUG")


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="PDSERVE_TTFT_SLO_S='soon'"):
        shared.resolve(None, "autoscale", {"PDSERVE_TTFT_SLO_S": "soon"})
    with pytest.raises(ConfigError, match="allowed: DEBUG"):
        shared.resolve(None, "router", {"PDSERVE_LOG_LEVEL": "loud"})



@pytest.mark.parametrize("url", ["redis-host:6379", "foo://bar", "http://redis:6379/0"])
def test_a_redis_url_without_a_redis_scheme_is_refused(url: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Refused at parse time (exit 2 with the reason), not as redis-py's traceback later."""
    from serve.cli import main as cli_main

    with pytest.raises(ConfigError, match="not a Redis URL"):
        shared.resolve(None, "autoscale status", {"PDSERVE_REDIS_URL": url})
    with pytest.raises(SystemExit) as exc:
        cli_main(["autoscale", "status", "--redis-url", url])
    assert exc.value.code == 2
    assert "not a Redis URL" in capsys.readouterr().err


def test_redis_urls_of_every_redis_scheme_are_taken() -> None:
    for url in ("redis://r:6379/0", "rediss://:pw@r:6380/1", "unix:///run/redis.sock"):
        assert shared.resolve(None, "router", {"PDSERVE_REDIS_URL": url})["redis_url"].value == url

# ---- pdserve up passes its settings on ---------------------------------------------------

def test_up_passes_shared_settings_to_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.autoscale.service import settings_from_args as autoscale_settings
    from router.config import load
    from serve.cli import _parser
    from serve.supervisor import Cluster, settings_from_args

    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)  # no keyring file for the test
    monkeypatch.setenv("PDSERVE_TPOT_SLO_S", "0.3")
    args = _parser().parse_args(["up", "--ttft-slo-s", "2", "--max-in-flight-per-worker", "3",
                                 "--request-timeout-s", "30", "--decode-policy", "kv_aware",
                                 "--kv-pull-timeout-s", "5", "--log-level", "warning"])
    cluster = Cluster(settings_from_args(args))
    monkeypatch.delenv("PDSERVE_TPOT_SLO_S")  # the children must get it as a flag
    router_flags = cluster._passed_on("router")
    assert "--tpot-slo-s=0.3" in router_flags  # the adaptive path decision plans for it
    router = load(router_flags, env={})
    assert (router.ttft_slo_s, router.tpot_slo_s, router.max_in_flight_per_worker,
            router.request_timeout_s, router.decode_policy, router.log_level) == (
        2.0, 0.3, 3, 30.0, "kv_aware", "WARNING")
    scale_args = _parser().parse_args(["autoscale", *cluster._passed_on("autoscale")])
    planner = autoscale_settings(scale_args).planner
    assert (planner.ttft_slo_s, planner.tpot_slo_s, scale_args.log_level) == (2.0, 0.3,
                                                                               "WARNING")
    assert cluster._passed_on("worker") == ["--log-level=WARNING", "--kv-pull-timeout-s=5.0"]


# ---- pdserve config show -----------------------------------------------------------------

def _show(argv: list[str], env: dict[str, str]) -> str:
    from serve.cli import _parser, show_config

    return show_config(_parser().parse_args(["config", "show", *argv]), env)


def _rows(text: str) -> dict[str, list[str]]:
    """setting -> [value, source, flag, env] (columns are two or more spaces apart)."""
    lines = text.splitlines()
    assert lines[0].split() == ["setting", "value", "source", "flag", "env"]
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    return {row[0]: row[1:] for row in cells}


def test_config_show_attributes_each_value() -> None:
    text = _show(["--policy", "round_robin", "--slo-tpot", "0.2"],
                 {"PDSERVE_TTFT_SLO_S": "3", "PDSERVE_REDIS_URL": "redis://:pw@cache:6379/1",
                  "PDSERVE_ROUTER_LOG_LEVEL": "error"})
    rows = _rows(text)
    assert set(rows) == set(shared.SETTINGS)
    assert rows["policy"] == ["round_robin", "flag --policy", "--policy", "PDSERVE_POLICY"]
    assert rows["tpot_slo_s"][:2] == ["0.2", "flag --slo-tpot (deprecated)"]
    assert rows["ttft_slo_s"][:2] == ["3.0", "env PDSERVE_TTFT_SLO_S"]
    assert rows["redis_url"][:2] == ["redis://:***@cache:6379/1", "env PDSERVE_REDIS_URL"]
    assert rows["log_level"][:2] == ["ERROR", "env PDSERVE_ROUTER_LOG_LEVEL (deprecated)"]
    assert rows["kv_lease_s"] == ["30.0", "default", "--kv-lease-s", "PDSERVE_KV_LEASE_S"]
    assert "pw" not in text


def test_config_show_json_for_one_command() -> None:
    doc = json.loads(_show(["--command", "worker", "--json", "--kv-lease-s", "9"], {}))
    assert doc["command"] == "worker"
    rows = {r["setting"]: r for r in doc["settings"]}
    assert list(rows) == list(shared.COMMANDS["worker"])
    assert rows["redis_url"]["value"] is None  # a standalone worker registers only if told
    assert rows["redis_url"]["source"] == "default"
    assert (rows["kv_lease_s"]["value"], rows["kv_lease_s"]["source"]) == (9.0,
                                                                            "flag --kv-lease-s")
    assert rows["kv_lease_s"]["commands"] == ["worker", "up", "chaos"]


def test_config_show_prints_unset_and_aligns_columns_to_their_content() -> None:
    text = _show(["--command", "worker", "--kv-pull-timeout-s", "5"],
                 {"PDSERVE_KV_LEASE_S": "12"})
    rows = _rows(text)
    assert rows["redis_url"][:2] == ["unset", "default"]
    assert rows["otlp_traces_endpoint"][:2] == ["unset", "default"]
    assert "None" not in text
    # each column starts at the same offset on every line, the longest source included
    lines = text.splitlines()
    flag, env = lines[0].index("flag"), lines[0].index("env")
    assert all(line[flag - 2:flag + 2] == "  --" and line[env - 2:env + 8] == "  PDSERVE_"
               for line in lines[1:]), text


def test_config_show_command_line(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from serve.cli import main

    monkeypatch.setenv("PDSERVE_POLICY", "prefix_only")
    assert main(["config", "show", "--command", "router", "--log-level", "error"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["policy"][:2] == ["prefix_only", "env PDSERVE_POLICY"]
    assert rows["log_level"][:2] == ["ERROR", "flag --log-level"]
    assert rows["tpot_slo_s"][:2] == ["0.1", "default"]  # the adaptive decision plans for it


def test_readme_table_matches_the_code() -> None:
    """README's "Settings shared by every command" table is the table of router.settings."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    head = "| setting | flag | env | default | commands |"
    assert head in readme
    rows: dict[str, list[str]] = {}
    for line in readme.split(head, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    assert list(rows) == list(shared.SETTINGS)
    for name, (flag, env, dflt, commands) in rows.items():
        s = shared.SETTINGS[name]
        assert (flag, env) == (s.flag, s.env), name
        assert dflt == ("unset" if s.default is None else str(s.default)), name
        assert commands.split(", ") == [c for c in ("up", "router", "worker", "autoscale",
                                                    "autoscale status", "bench", "sim", "chaos")
                                        if c in shared.used_by(name)], name


def test_up_child_command_lines_parse_in_the_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router, worker and autoscaler command lines `pdserve up --autoscale` builds are
    accepted by those commands and carry the settings (no process is started)."""
    from router.autoscale.service import settings_from_args as autoscale_settings
    from router.config import load
    from serve import supervisor
    from serve.cli import _parser
    from serve.redis_server import free_port
    from serve.worker import settings_from_args as worker_settings

    cmds: list[list[str]] = []

    class FakePopen:
        def __init__(self, cmd: list[str], **_: Any) -> None:
            cmds.append(cmd)

        def poll(self) -> int | None:
            return None

    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)
    monkeypatch.setattr(supervisor.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(supervisor, "ensure_redis", lambda url: (None, url))  # one answers
    monkeypatch.setattr(supervisor, "free_port", lambda host: 8123)
    args = _parser().parse_args(["up", "--model", "m", "--autoscale", "--redis-url",
                                 "redis://r:1/0", "--policy", "least_loaded", "--kv-lease-s",
                                 "7", "--ttft-slo-s", "4", "--tpot-slo-s", "0.2",
                                 "--request-timeout-s", "60", "--port", str(free_port())])
    cluster = supervisor.Cluster(supervisor.settings_from_args(args))
    cluster.start()  # binds the router's socket for real (closed below)
    assert cluster._listener is not None
    listen_fd = cluster._listener.fileno()
    cluster._listener.close()
    by_module = {cmd[2]: cmd[3:] for cmd in cmds}
    assert set(by_module) == {"serve.cli", "router.main"}
    router = load(by_module["router.main"], env={})
    assert (router.redis_url, router.policy, router.ttft_slo_s, router.request_timeout_s) == (
        "redis://r:1/0", "least_loaded", 4.0, 60.0)
    assert router.listen_fd == listen_fd  # it serves on the supervisor's socket
    workers = [c[3:] for c in cmds if c[3:4] == ["worker"]]
    assert len(workers) == 2
    for argv in workers:
        w_args, extra = _parser().parse_known_args(argv)
        w = worker_settings(w_args, extra)
        assert (w.redis_url, w.lease_s, w.extra_vllm_args) == ("redis://r:1/0", 7.0, ())
    scale_argv = next(c[3:] for c in cmds if c[3:4] == ["autoscale"])
    planner = autoscale_settings(_parser().parse_args(scale_argv)).planner
    assert (planner.ttft_slo_s, planner.tpot_slo_s) == (4.0, 0.2)


# ---- pdserve autoscale's own flags ------------------------------------------------------------

def test_autoscale_help_names_every_default_env_var_and_the_status_subcommand(
        capsys: pytest.CaptureFixture[str]) -> None:
    from serve.cli import _parser, main

    with pytest.raises(SystemExit) as info:
        main(["autoscale", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    scale = _sub(_parser(), "autoscale")
    options = [a for a in scale._actions
               if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]
    assert len(options) >= 20
    for action in options:
        assert action.help and "default" in action.help and "PDSERVE_" in action.help, (
            action.option_strings, action.help)
    assert "PDSERVE_AUTOSCALE_INTERVAL_S; default 10.0" in text
    assert "PDSERVE_AUTOSCALE_COOLDOWN_S; default 60.0" in text
    assert "pdserve autoscale status [--changes] [--limit N]" in text


def test_autoscale_flags_read_their_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.autoscale.service import settings_from_args
    from serve.cli import _parser

    monkeypatch.setenv("PDSERVE_AUTOSCALE_MIN_REPLICAS", "2")
    monkeypatch.setenv("PDSERVE_AUTOSCALE_PREDICTOR", "ewma")
    monkeypatch.setenv("PDSERVE_AUTOSCALE_METRICS_PORT", "9109")
    monkeypatch.setenv("PDSERVE_MAX_PREFILL", "6")  # the older name still works
    monkeypatch.setenv("PDSERVE_AUTOSCALE_MAX_DECODE", "5")
    s = settings_from_args(_parser().parse_args(["autoscale"]))
    assert (s.planner.min_replicas, s.planner.predictor, s.metrics_port) == (2, "ewma", 9109)
    assert (s.planner.max_prefill_replicas, s.planner.max_decode_replicas) == (6, 5)
    flag = settings_from_args(_parser().parse_args(["autoscale", "--min-replicas", "3"]))
    assert flag.planner.min_replicas == 3  # a flag beats its env var


def test_model_tiny_help_names_the_default_dir(capsys: pytest.CaptureFixture[str]) -> None:
    from serve.cli import main
    from serve.tiny_model import default_tiny_model_dir

    with pytest.raises(SystemExit):
        main(["model", "tiny", "--help"])
    assert str(default_tiny_model_dir()) in " ".join(capsys.readouterr().out.split())
