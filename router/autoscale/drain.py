"""Pod-side drain for a scale-down in Kubernetes: the preStop hook and the readiness check.

    python -m router.autoscale.drain prestop [--port 8100] [--redis-url URL] [--timeout-s 150]
    python -m router.autoscale.drain ready [--port 8100]

``prestop`` runs when the scale subresource removes a worker pod, in this order:

1. writes the draining marker, so ``ready`` fails from now on (the pod reports not-ready and
   leaves its Service's endpoints);
2. deregisters the pod's workers from routing: every registry entry this pod wrote
   (ids ``<role>-<hostname>-<suffix>``, as ``serve.worker`` names them) goes into the
   registry's draining set, and routers send them no new request;
3. only then drains: waits until the worker runs and queues no request and holds no KV
   blocks (unpulled leases) on two scrapes in a row, or ``timeout_s``.

Then kubelet sends SIGTERM and the worker deletes its registry entry on exit. Step 2 does not
delete the entry itself: the worker's heartbeat rewrites an expired or deleted key (a rejoin),
which would put a draining worker back into routing.

``ready`` exits 0 only when the marker is absent and the worker's ``/health`` answers 200.

Parameters (defaults) are the fields of :class:`DrainConfig`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from router import settings as shared

logger = logging.getLogger(__name__)

IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc")


@dataclass(frozen=True)
class DrainConfig:
    """Where the pod's worker and the registry are, and how long a drain may take."""

    worker_url: str = "http://127.0.0.1:8100"
    """The worker's own HTTP server (``/metrics``, ``/health``)."""
    redis_url: str = "redis://pdserve-redis:6379/0"
    prefix: str = "pdserve"
    """Registry key prefix."""
    hostname: str = ""
    """The pod's hostname (its name); empty: this machine's."""
    marker: Path = Path("/tmp/pdserve-draining")
    """Exists from the start of a drain; the readiness check fails while it does."""
    timeout_s: float = 150.0
    """Give up waiting for idle after this long (keep below terminationGracePeriodSeconds)."""
    poll_s: float = 1.0
    """Seconds between idle checks."""
    idle_polls: int = 2
    """Consecutive idle scrapes that end the drain."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.poll_s <= 0 or self.idle_polls < 1:
            raise ValueError("need timeout_s > 0, poll_s > 0 and idle_polls >= 1")

    def host(self) -> str:
        return self.hostname or socket.gethostname()


def own_worker_ids(worker_ids: list[str], hostname: str) -> list[str]:
    """The ids among ``worker_ids`` that a worker on ``hostname`` registered."""
    return [w for w in worker_ids
            if w.partition("-")[2].rpartition("-")[0] == hostname]


async def deregister_from_routing(config: DrainConfig) -> list[str]:
    """Put every worker of this pod into the registry's draining set; returns their ids."""
    from router.state.registry import WorkerRegistry

    registry = WorkerRegistry(config.redis_url, prefix=config.prefix)
    try:
        ids = own_worker_ids([r.worker_id for r in await registry.list()], config.host())
        for worker_id in ids:
            await registry.mark_draining(worker_id)
        return ids
    finally:
        await registry.close()


async def wait_idle(config: DrainConfig) -> bool:
    """Poll the worker's metrics until idle ``idle_polls`` times in a row; False on timeout.

    A worker that no longer answers counts as idle (it is already gone)."""
    import httpx

    from router.samples import total
    from router.state.worker_load import scrape

    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.timeout_s
    idle = 0
    async with httpx.AsyncClient(timeout=3.0) as client:
        while loop.time() < deadline:
            samples = await scrape(client, config.worker_url)
            idle = idle + 1 if sum(total(samples, n) for n in IDLE_GAUGES) == 0 else 0
            if idle >= config.idle_polls:
                return True
            await asyncio.sleep(config.poll_s)
    return False


async def prestop(config: DrainConfig) -> bool:
    """Marker, deregistration from routing, then the drain; True when the worker went idle."""
    config.marker.parent.mkdir(parents=True, exist_ok=True)
    config.marker.touch()
    try:
        ids = await deregister_from_routing(config)
        logger.info("out of routing: %s", ", ".join(ids) or "(no registered worker)")
    except Exception as exc:  # Redis down: still drain what the worker holds
        logger.warning("cannot deregister from routing: %s", exc)
    idle = await wait_idle(config)
    logger.info("drain %s", "done" if idle else f"timed out after {config.timeout_s:.0f} s")
    return idle


def ready(config: DrainConfig) -> bool:
    """Not draining and healthy (stdlib only: kubelet runs this every few seconds)."""
    if config.marker.exists():
        return False
    try:
        with urllib.request.urlopen(f"{config.worker_url}/health", timeout=3) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def parser() -> argparse.ArgumentParser:
    """Flags of ``python -m router.autoscale.drain``."""
    ap = argparse.ArgumentParser(prog="python -m router.autoscale.drain",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["prestop", "ready"])
    ap.add_argument("--port", type=int, default=8100, help="the worker's HTTP port")
    shared.add_arguments(ap, "drain")
    ap.add_argument("--prefix", default="pdserve")
    ap.add_argument("--hostname", default="")
    ap.add_argument("--marker", default=str(DrainConfig.marker))
    ap.add_argument("--timeout-s", type=float, default=DrainConfig.timeout_s)
    return ap


def main(argv: list[str] | None = None) -> int:
    """``prestop`` or ``ready``; exit status 0 = idle / ready."""
    args = parser().parse_args(argv)
    shared.resolve_into(args, "drain")
    config = DrainConfig(worker_url=f"http://127.0.0.1:{args.port}", redis_url=args.redis_url,
                         prefix=args.prefix, hostname=args.hostname, marker=Path(args.marker),
                         timeout_s=args.timeout_s)
    if args.command == "ready":
        return 0 if ready(config) else 1
    logging.basicConfig(level=logging.INFO, format="preStop: %(message)s", stream=sys.stderr)
    return 0 if asyncio.run(prestop(config)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
