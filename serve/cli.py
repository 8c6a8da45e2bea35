"""The `pdserve` command: `up`, `worker`, `router`, `autoscale`, `config show`, `model tiny`,
`chaos`, `doctor`, and the commands other packages register (serve.commands: `bench`, `sim`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

from router import settings as shared
from router.errors import ConfigError
from serve.commands import plugin_commands, summary
from serve.commands import run as run_plugin


def _parser() -> argparse.ArgumentParser:
    from router.config import package_version
    from serve import supervisor, worker
    from serve.tiny_model import default_tiny_model_dir

    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Disaggregated prefill/decode serving on vLLM.")
    shared.add_arguments(parser, None, ("log_level",))
    parser.add_argument("--version", action="version", version=f"pdserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the local cluster (Redis, workers, router)")
    supervisor.add_up_args(up)
    w = sub.add_parser("worker", help="run one vLLM worker with the pdserve KV connector")
    worker.add_worker_args(w)
    sub.add_parser("router", help="run the OpenAI-compatible router (see `pdserve router -h`)",
                   add_help=False)
    for name, ep in plugin_commands().items():
        sub.add_parser(name, help=summary(ep), add_help=False)
    sub.add_parser("chaos", help="inject faults into a real local cluster under load and prove "
                   "nothing is lost (see `pdserve chaos -h`)", add_help=False)
    sub.add_parser("doctor", help="what the KV transport can use here (UCX, RDMA, CUDA, "
                   "same-host reads)", add_help=False)
    from router.autoscale.service import add_autoscale_args

    scale = sub.add_parser(
        "autoscale", help="size the prefill and decode pools to the SLOs "
        "(`pdserve autoscale status`: its recent decisions)",
        description="Size the prefill and decode pools to the SLOs.",
        epilog="subcommand: `pdserve autoscale status [--changes] [--limit N]` prints the "
               "autoscaler's recent decisions (see `pdserve autoscale status -h`)")
    add_autoscale_args(scale)
    config = sub.add_parser("config", help="the settings pdserve commands share")
    csub = config.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print each shared setting's effective value and where "
                           "it came from (default, env VAR or flag)")
    show.add_argument("--command", dest="for_command", choices=sorted(shared.COMMANDS),
                      help="only the settings this command takes, with its defaults")
    show.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    shared.add_arguments(show, None)
    model = sub.add_parser("model", help="build models")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("tiny", help="write the tiny offline Llama + tokenizer")
    tiny.add_argument("--out", default=None,
                      help=f"output dir (default: {default_tiny_model_dir()}, under "
                           "$PDSERVE_CACHE/models when set)")
    tiny.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser


def show_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str:
    """`pdserve config show`: each shared setting, its value and its source, as text or JSON."""
    from serve.redis_server import redacted_url

    command = args.for_command
    resolved = shared.resolve(args, command, env,
                              names=None if command else tuple(shared.SETTINGS))
    rows: list[dict[str, Any]] = []
    for name, r in resolved.items():
        s = shared.SETTINGS[name]
        value = redacted_url(r.value) if name == "redis_url" and r.value else r.value
        rows.append({"setting": name, "value": value, "source": r.source, "flag": s.flag,
                     "env": s.env, "commands": list(shared.used_by(name))})
    if args.json:
        return json.dumps({"command": command, "settings": rows}, indent=2) + "\n"
    head = ("setting", "value", "source", "flag", "env")
    cells: list[tuple[str, ...]] = [
        head, *[(r["setting"], "unset" if r["value"] is None else str(r["value"]), r["source"],
                 r["flag"], r["env"]) for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                   + "\n" for row in cells)


def _leading_log_level(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split a ``--log-level X`` given before the subcommand from the rest of ``argv``."""
    if argv[:1] == ["--log-level"] and len(argv) > 1:
        return argv[:2], argv[2:]
    if argv[:1] and argv[0].startswith("--log-level="):
        return argv[:1], argv[1:]
    return [], argv


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdserve` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    level, rest = _leading_log_level(argv)
    if rest[:1] in (["router"], ["chaos"]):  # `--log-level X router` = `router --log-level X`
        argv = [rest[0], *level, *rest[1:]]
    if argv[:1] == ["router"]:
        from router.main import main as router_main

        return router_main(argv[1:])
    plugins = plugin_commands()
    if argv[:1] and argv[0] in plugins:
        return run_plugin(plugins[argv[0]], argv[1:])
    if argv[:1] == ["doctor"]:
        from serve.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["chaos"]:
        from serve.chaos.runner import main as chaos_main

        return chaos_main(argv[1:])
    if argv[:2] == ["autoscale", "status"]:
        from router.autoscale.decisions import status_main

        return status_main(argv[2:])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "worker":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        level = shared.resolve(args, None, names=("log_level",))["log_level"].value
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from router.main import quiet_http_clients

    quiet_http_clients()
    if args.command == "config":
        try:
            print(show_config(args), end="")
        except ConfigError as exc:
            parser.error(str(exc))
        return 0
    if args.command == "model":
        from serve.tiny_model import build_tiny_model

        print(build_tiny_model(args.out, force=args.force))
        return 0
    if args.command == "worker":
        from serve.worker import WorkerLauncher, settings_from_args

        try:
            worker = settings_from_args(args, extra)
        except ValueError as exc:
            parser.error(str(exc))
        return asyncio.run(WorkerLauncher(worker).run())
    if args.command == "autoscale":
        from router.autoscale.service import run_autoscaler
        from router.autoscale.service import settings_from_args as scale_settings

        return asyncio.run(run_autoscaler(scale_settings(args)))
    from serve.errors import StartupError
    from serve.supervisor import run_cluster
    from serve.supervisor import settings_from_args as up_settings

    try:
        settings = up_settings(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(run_cluster(settings))
    except StartupError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
