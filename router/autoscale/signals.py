"""Turn two metric snapshots into one planner :class:`Observation` (pure).

A snapshot maps ``(sample name, frozenset(labels))`` to a value, as scraped from the router
and from each worker. Counters and histograms are differenced between the two snapshots; a
worker present in only one of them contributes nothing (it joined or left in between).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from router.autoscale.planner import Observation
from router.samples import Samples, total

ARRIVALS = "pdserve_router_requests_received_total"
"""The router's counter of requests as they arrive."""
WAITING = "vllm:num_requests_waiting"
"""vLLM's gauge of requests queued in the engine (not yet scheduled)."""


def histogram_delta(before: Samples, after: Samples, name: str
                    ) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, cumulative buckets [(le, count)]) of a histogram between two snapshots."""
    def buckets(samples: Samples) -> dict[float, float]:
        out: dict[float, float] = {}
        for (n, lab), v in samples.items():
            if n == f"{name}_bucket":
                le = float(dict(lab)["le"])
                out[le] = out.get(le, 0.0) + v
        return out

    b0, b1 = buckets(before), buckets(after)
    cum = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
    return (total(after, f"{name}_sum") - total(before, f"{name}_sum"),
            total(after, f"{name}_count") - total(before, f"{name}_count"), cum)


def quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style ``histogram_quantile`` over cumulative buckets; None when empty."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span > 0 else 1.0)
        prev_le, prev_count = le, count
    return prev_le


@dataclass(frozen=True)
class Snapshot:
    """Everything scraped at one instant."""

    time_s: float
    router: Samples
    prefill: Mapping[str, Samples]
    """worker id -> samples"""
    decode: Mapping[str, Samples]


def _worker_delta(before: Mapping[str, Samples], after: Mapping[str, Samples], name: str,
                  **labels: str) -> float:
    return sum(total(after[w], name, **labels) - total(before[w], name, **labels)
               for w in after if w in before)


def _pool_histogram(before: Mapping[str, Samples], after: Mapping[str, Samples], name: str
                    ) -> tuple[float, float, list[tuple[float, float]]]:
    """:func:`histogram_delta` summed over the workers present in both snapshots."""
    total_sum = total_count = 0.0
    buckets: dict[float, float] = {}
    for w in after:
        if w in before:
            s, n, b = histogram_delta(before[w], after[w], name)
            total_sum, total_count = total_sum + s, total_count + n
            for le, c in b:
                buckets[le] = buckets.get(le, 0.0) + c
    return total_sum, total_count, sorted(buckets.items())


def observe(before: Snapshot, after: Snapshot) -> Observation:
    """The planner's view of the interval between two snapshots.

    Lengths are per request served (vLLM's per-request histograms), not per arrival: in a
    backlog fewer are served than arrive, and dividing by arrivals would shrink the lengths
    just when the load grows. The p90 uncached prompt is the p90 prompt scaled by the uncached
    share of prompt tokens (vLLM's histogram counts whole prompts). Arrivals are counted when
    they reach the router, not when they are answered: answers to long streams come in lumps
    (three streams started together end together), and an interval between two lumps would read
    as no load at all. A pool's queue is the gauge at the interval's end, over every worker
    scraped then."""
    interval = max(1e-9, after.time_s - before.time_s)
    arrivals = max(0.0, total(after.router, ARRIVALS) - total(before.router, ARRIVALS))
    isl_tokens = _worker_delta(before.prefill, after.prefill,
                               "vllm:prompt_tokens_by_source_total", source="local_compute")
    hit_tokens = _worker_delta(before.prefill, after.prefill,
                               "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    _, prefilled, prompt_b = _pool_histogram(before.prefill, after.prefill,
                                             "vllm:request_prompt_tokens")
    osl_tokens, decoded, _ = _pool_histogram(before.decode, after.decode,
                                             "vllm:request_generation_tokens")
    p90_prompt = quantile(prompt_b, 0.9)
    uncached_share = isl_tokens / (isl_tokens + hit_tokens) if isl_tokens + hit_tokens else 1.0
    ttft_sum, ttft_n, ttft_b = histogram_delta(before.router, after.router,
                                               "pdserve_router_ttft_seconds")
    tpot_sum, tpot_n, tpot_b = _pool_histogram(before.decode, after.decode,
                                               "vllm:inter_token_latency_seconds")
    return Observation(
        now_s=after.time_s, interval_s=interval, arrivals=int(arrivals),
        mean_isl=isl_tokens / prefilled if prefilled else 0.0,
        mean_prompt_tokens=(isl_tokens + hit_tokens) / prefilled if prefilled else None,
        mean_osl=osl_tokens / decoded if decoded else 0.0,
        p90_isl=None if p90_prompt is None else p90_prompt * uncached_share,
        prefill_replicas=len(after.prefill), decode_replicas=len(after.decode),
        ttft_p90_s=quantile(ttft_b, 0.9), ttft_mean_s=ttft_sum / ttft_n if ttft_n else None,
        tpot_p90_s=quantile(tpot_b, 0.9), tpot_mean_s=tpot_sum / tpot_n if tpot_n else None,
        prefill_queued=sum(total(s, WAITING) for s in after.prefill.values()),
        decode_queued=sum(total(s, WAITING) for s in after.decode.values()))
