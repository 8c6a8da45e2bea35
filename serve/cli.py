"""The `pdserve` command: `up`, `worker`, `router`, `model tiny`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    from router.config import package_version
    from serve import supervisor, worker

    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Disaggregated prefill/decode serving on vLLM.")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--version", action="version", version=f"pdserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the local cluster (Redis, workers, router)")
    supervisor.add_up_args(up)
    w = sub.add_parser("worker", help="run one vLLM worker with the pdserve KV connector")
    worker.add_worker_args(w)
    sub.add_parser("router", help="run the OpenAI-compatible router (see `pdserve router -h`)",
                   add_help=False)
    sub.add_parser("bench", help="load-test harness: replay/synth/sweep/compare/profile "
                   "(see `pdserve bench -h`)", add_help=False)
    sub.add_parser("sim", help="cluster simulator (see `pdserve sim -h`)", add_help=False)
    sub.add_parser("chaos", help="inject faults into a real local cluster under load and prove "
                   "nothing is lost (see `pdserve chaos -h`)", add_help=False)
    sub.add_parser("doctor", help="what the KV transport can use here (UCX, RDMA, CUDA, "
                   "same-host reads)", add_help=False)
    from router.autoscale.service import add_autoscale_args

    scale = sub.add_parser("autoscale", help="size the prefill and decode pools to the SLOs "
                           "(`pdserve autoscale status`: its recent decisions)")
    add_autoscale_args(scale)
    model = sub.add_parser("model", help="build models")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("tiny", help="write the tiny offline Llama + tokenizer")
    tiny.add_argument("--out", default=None, help="output dir (default: the cache)")
    tiny.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdserve` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:
        from router.main import main as router_main

        return router_main(argv[1:])
    if argv[:1] == ["bench"]:
        from bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["sim"]:
        from bench.sim.cli import main as sim_main

        return sim_main(argv[1:])
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
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from router.main import quiet_http_clients

    quiet_http_clients()
    if args.command == "model":
        from serve.tiny_model import build_tiny_model

        print(build_tiny_model(args.out, force=args.force))
        return 0
    if args.command == "worker":
        from serve.worker import WorkerLauncher, settings_from_args

        return asyncio.run(WorkerLauncher(settings_from_args(args, extra)).run())
    if args.command == "autoscale":
        from router.autoscale.service import run_autoscaler
        from router.autoscale.service import settings_from_args as scale_settings

        return asyncio.run(run_autoscaler(scale_settings(args)))
    from serve.supervisor import run_cluster
    from serve.supervisor import settings_from_args as up_settings

    return asyncio.run(run_cluster(up_settings(args)))


if __name__ == "__main__":
    raise SystemExit(main())
