"""Transfer telemetry: collected in the worker, shipped by vLLM, exported as ``pdserve_kv_*``.

vLLM moves a connector's ``KVConnectorStats`` from the worker to the API server process each
step and hands it to the connector's Prometheus metrics there, so our counters appear on the
worker's own ``/metrics`` next to ``vllm:*``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtransfer.config import ConnectorConfig
from kvtransfer.timeline import PHASES, PhaseJoiner, RequestTimeline
from kvtransfer.tracing import emit_spans

logger = logging.getLogger(__name__)

_MAX_TRACES = 4096

CONTROL_COUNTERS = {
    "dropped": ("dropped_messages", "Control messages dropped unread: the prefill's request "
                "queue was full (a flood)."),
    "failed_replies": ("failed_replies", "Answers to lease messages that could not be sent "
                       "(the requester was gone)."),
    "unanswered": ("unanswered_strangers", "Answers to lease messages dropped: the requester "
                   "proved no lease and the transport held no connection to it (security "
                   "review finding 15)."),
    "foreign": ("foreign_messages", "NIXL control messages not from the agent they name, or "
                "replies from another agent than the one asked: dropped."),
}
"""``pdserve_kv_control_<key>_total`` -> (the transport engine's counter, its meaning); a
transport without that counter (tcp answers on the request's own connection) reports 0."""

_COUNTERS = ("pulls", "pulls_same_host", "pull_failures", "pulled_bytes", "pulled_blocks",
             "leases_released", "leases_expired", "leases_renewed", "leases_refused",
             "refused_params", *(f"control_{name}" for name in CONTROL_COUNTERS))
PULL_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                        5.0, 10.0)


PHASE_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                         0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _empty() -> dict[str, Any]:
    return {**{k: 0 for k in _COUNTERS}, "pull_seconds": [], "failure_reasons": {},
            "events": [], "traces": {}}


@dataclass
class TransferStats(KVConnectorStats):
    """Counters since the last report, plus per-pull durations."""

    data: dict[str, Any] = field(default_factory=_empty)

    def record_pull(self, nbytes: int, nblocks: int, seconds: float,
                    same_host: bool = False) -> None:
        """One successful pull (``same_host``: read with process_vm_readv, not over UCX)."""
        self.data["pulls"] += 1
        self.data["pulls_same_host"] += int(same_host)
        self.data["pulled_bytes"] += nbytes
        self.data["pulled_blocks"] += nblocks
        self.data["pull_seconds"].append(seconds)

    def record_failure(self, reason: str) -> None:
        """One failed pull (its blocks are recomputed)."""
        self.data["pull_failures"] += 1
        key = reason.split(":")[0].split(" ")[0][:32]
        self.data["failure_reasons"][key] = self.data["failure_reasons"].get(key, 0) + 1

    def record_event(self, request_id: str, name: str, at: float | None = None) -> None:
        """One timeline event of ``request_id`` (see :mod:`kvtransfer.timeline`)."""
        self.data["events"].append((request_id, name, time.time() if at is None else at))

    def record_trace(self, request_id: str, headers: dict[str, str]) -> None:
        """The W3C trace context ``request_id`` arrived with (vLLM tracing on)."""
        self.data["traces"][request_id] = headers

    def record_leases(self, released: int, expired: int, renewed: int = 0,
                      refused: int = 0) -> None:
        """Leases ended, renewals granted and lease messages refused since the last report."""
        self.data["leases_released"] += released
        self.data["leases_expired"] += expired
        self.data["leases_renewed"] += renewed
        self.data["leases_refused"] += refused

    def record_control(self, key: str, n: int) -> None:
        """``n`` more of the transport's control-channel counter ``key`` (CONTROL_COUNTERS)."""
        self.data[f"control_{key}"] += n

    def record_refused(self) -> None:
        """One request whose ``kv_transfer_params`` were refused (unsigned, forged, stale)."""
        self.data["refused_params"] += 1

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> TransferStats:
        for key in _COUNTERS:
            self.data[key] += other.data.get(key, 0)
        self.data["pull_seconds"].extend(other.data.get("pull_seconds", []))
        self.data["events"].extend(other.data.get("events", []))
        self.data["traces"].update(other.data.get("traces", {}))
        for reason, n in other.data.get("failure_reasons", {}).items():
            self.data["failure_reasons"][reason] = self.data["failure_reasons"].get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        secs = self.data["pull_seconds"]
        gb = self.data["pulled_bytes"] / 1e9
        total_s = sum(secs)
        return {
            "pulls": self.data["pulls"],
            "pull_failures": self.data["pull_failures"],
            "pulled_MB": round(self.data["pulled_bytes"] / 1e6, 3),
            "avg_pull_ms": round(1e3 * total_s / len(secs), 3) if secs else 0.0,
            "GB_per_s": round(gb / total_s, 3) if total_s > 0 else 0.0,
            "leases_released": self.data["leases_released"],
            "leases_expired": self.data["leases_expired"],
        }

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _COUNTERS) and not self.data["events"]


class TransferPromMetrics(KVConnectorPromMetrics):
    """``pdserve_kv_*`` metrics registered in the worker's API server process."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls: Any = self._counter_cls
        histogram_cls: Any = self._histogram_cls
        docs = {
            "pulls": "KV pulls completed (decode side).",
            "pulls_same_host": "KV pulls read with the same-host path (process_vm_readv).",
            "pull_failures": "KV pulls that failed; their blocks were recomputed.",
            "pulled_bytes": "Bytes of KV pulled over UCX (decode side).",
            "pulled_blocks": "KV blocks pulled over UCX (decode side).",
            "leases_released": "Prefill leases ended by a decode release.",
            "leases_expired": "Prefill leases that expired before any release.",
            "leases_renewed": "Prefill lease renewals granted to decodes still queueing the "
                              "request.",
            "leases_refused": "Lease releases or renewals the prefill refused: a wrong lease "
                              "token, or a lease already released or expired (a repeat).",
            "refused_params": "Requests whose kv_transfer_params were refused (unsigned, forged "
                              "or stale signature): served without lease or pull.",
            **{f"control_{key}": doc for key, (_, doc) in CONTROL_COUNTERS.items()},
        }
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in docs.items():
            metric = counter_cls(name=f"pdserve_kv_{key}_total", documentation=doc,
                                       labelnames=labelnames)
            self._counters[key] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}
        hist = histogram_cls(name="pdserve_kv_pull_duration_seconds",
                                   documentation="Time from posting the reads to a released lease.",
                                   labelnames=labelnames, buckets=PULL_SECONDS_BUCKETS)
        self._hist: dict[int, Any] = {idx: hist.labels(*values)
                                      for idx, values in per_engine_labelvalues.items()}
        phase = histogram_cls(
            name="pdserve_kv_phase_seconds",
            documentation="Duration of each connector phase of one request (see "
                          "kvtransfer.timeline: decode_* from seeing a remote prefill to the "
                          "first scheduled step, prefill_* from admission to lease release).",
            labelnames=[*labelnames, "phase"], buckets=PHASE_SECONDS_BUCKETS)
        self._phase = {idx: {p: phase.labels(*values, p) for p in PHASES}
                       for idx, values in per_engine_labelvalues.items()}
        self._joiners = {idx: PhaseJoiner() for idx in per_engine_labelvalues}
        self._traces: OrderedDict[str, dict[str, str]] = OrderedDict()
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        self._timeline_file = ConnectorConfig.from_extra_config(extra).timeline_file

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for seconds in transfer_stats_data.get("pull_seconds", []):
            self._hist[engine_idx].observe(seconds)
        self._traces.update(transfer_stats_data.get("traces") or {})
        while len(self._traces) > _MAX_TRACES:
            self._traces.popitem(last=False)
        events = transfer_stats_data.get("events")
        if events:
            done = self._joiners[engine_idx].add(tuple(e) for e in events)
            for timeline in done:
                for name, seconds in timeline.phases.items():
                    self._phase[engine_idx][name].observe(seconds)
                headers = self._traces.pop(timeline.request_id, None)
                if headers:
                    emit_spans(timeline, headers)
            if done and self._timeline_file:
                self._append(done)

    def _append(self, done: list[RequestTimeline]) -> None:
        """One JSON line per completed request (merged with the router's by bench tools)."""
        try:
            with open(self._timeline_file, "a") as fh:  # type: ignore[arg-type]
                for t in done:
                    fh.write(json.dumps({"source": "kv", "role": t.role,
                                         "request_id": t.request_id, "events": t.events,
                                         "phases": t.phases}) + "\n")
        except OSError as exc:
            logger.warning("cannot append to timeline file %s: %s", self._timeline_file, exc)
