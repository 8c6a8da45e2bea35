"""The autoscaler's decision log: every decision as a capped Redis list, and ``pdserve
autoscale status`` to read it.

Each planning interval appends one JSON record per pool (newest first) to
``{prefix}:autoscaler:decisions`` and trims the list to ``keep`` (1000) entries, whatever the
actuator (Redis, Kubernetes, compose). A record holds the wall time, the pool, the replicas
before (``current``) and after (``desired``), the reason, the load sized for, the forecast
(``predicted_load``) and the interval's ``observed_load`` (prefill: uncached tokens/s; decode:
output tokens/s), the burst ``headroom`` factor and one instance's capacity.

    pdserve autoscale status [--redis-url URL] [--prefix pdserve] [--limit 20] [--changes]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router import settings as shared
from router.autoscale.actuators import decisions_key
from router.autoscale.planner import Decision


@dataclass(frozen=True)
class DecisionRecord:
    """One pool's decision as stored and shown."""

    time_s: float
    """Wall-clock time (Unix seconds) of the decision."""
    pool: str
    current: int
    desired: int
    reason: str
    load: float
    predicted_load: float
    observed_load: float
    headroom: float
    capacity_per_instance: float

    @classmethod
    def of(cls, d: Decision, time_s: float) -> DecisionRecord:
        return cls(time_s, d.pool, d.current, d.desired, d.reason, round(d.load, 3),
                   round(d.predicted_load, 3), round(d.observed_load, 3), round(d.headroom, 3),
                   round(d.capacity_per_instance, 3))

    def to_json(self) -> str:
        return json.dumps({"time": self.time_s, **{k: v for k, v in asdict(self).items()
                                                   if k != "time_s"}})

    @classmethod
    def from_json(cls, raw: str | bytes) -> DecisionRecord:
        doc = json.loads(raw)
        return cls(float(doc["time"]), str(doc["pool"]), int(doc["current"]),
                   int(doc["desired"]), str(doc["reason"]), float(doc.get("load", 0.0)),
                   float(doc.get("predicted_load", 0.0)), float(doc.get("observed_load", 0.0)),
                   float(doc.get("headroom", 1.0)), float(doc.get("capacity_per_instance", 0.0)))


class DecisionLog:
    """Appends decisions to the capped Redis list and reads the recent ones."""

    def __init__(self, redis_url: str, prefix: str = "pdserve", keep: int = 1000) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._redis = aioredis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
        self._key, self._keep = decisions_key(prefix), keep

    async def record(self, decisions: Sequence[Decision], time_s: float) -> None:
        """Append one record per decision (newest first) and trim the list."""
        if not decisions:
            return
        records = [DecisionRecord.of(d, time_s).to_json() for d in decisions]
        await self._redis.lpush(self._key, *records)  # type: ignore[misc]
        await self._redis.ltrim(self._key, 0, self._keep - 1)  # type: ignore[misc]

    async def recent(self, limit: int = 20) -> list[DecisionRecord]:
        """The newest ``limit`` records, newest first."""
        raw = await self._redis.lrange(self._key, 0, max(0, limit - 1))  # type: ignore[misc]
        return [DecisionRecord.from_json(r) for r in raw]

    async def close(self) -> None:
        await self._redis.aclose()


def format_records(records: Sequence[DecisionRecord], now_s: float) -> str:
    """A table of ``records``, newest first, times as seconds ago."""
    if not records:
        return "no autoscaler decisions recorded yet"
    head = (f"{'ago':>6} {'pool':<8} {'from':>4} {'to':>4} {'reason':<10} {'observed':>10} "
            f"{'predicted':>10} {'headroom':>8} {'sized for':>10} {'cap/inst':>9}")
    lines = [head]
    for r in records:
        lines.append(
            f"{max(0.0, now_s - r.time_s):>5.0f}s {r.pool:<8} {r.current:>4} {r.desired:>4} "
            f"{r.reason:<10} {r.observed_load:>10.1f} {r.predicted_load:>10.1f} "
            f"{r.headroom:>8.2f} {r.load:>10.1f} {r.capacity_per_instance:>9.1f}")
    return "\n".join(lines)


async def _status(args: argparse.Namespace) -> list[DecisionRecord]:
    log = DecisionLog(args.redis_url, args.prefix)
    try:
        # read more than asked when filtering to changes: most intervals change nothing
        records = await log.recent(args.limit * (50 if args.changes else 1))
    finally:
        await log.close()
    if args.changes:
        records = [r for r in records if r.desired != r.current]
    return records[:args.limit]


def status_parser() -> argparse.ArgumentParser:
    """Flags of ``pdserve autoscale status``."""
    ap = argparse.ArgumentParser(prog="pdserve autoscale status",
                                 description="recent autoscaler decisions, newest first")
    shared.add_arguments(ap, "autoscale status")
    ap.add_argument("--prefix", default="pdserve")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--changes", action="store_true", help="only decisions that changed a pool")
    return ap


def status_main(argv: list[str] | None = None) -> int:
    """``pdserve autoscale status``: print the recent decisions; 2 if Redis is unreachable."""
    args = status_parser().parse_args(argv)
    if not shared.resolve_for_cli(args, "autoscale status", "pdserve autoscale status"):
        return 2
    try:
        records = asyncio.run(_status(args))
    except (RedisError, OSError) as exc:
        print(f"pdserve autoscale status: cannot read {args.redis_url}: {exc}", file=sys.stderr)
        return 2
    print(format_records(records, time.time()))
    return 0
