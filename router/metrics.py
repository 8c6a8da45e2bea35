"""Prometheus metrics of the router (``pdserve_router_*``, base units).

Each app gets its own :class:`CollectorRegistry` so several routers can live in one process
(tests); ``GET /metrics`` exposes it.

``model_name`` (vLLM's label name) is a served model some live worker registered: the router
answers a request for any other model with 404 before it has a model to label, and labels
requests it answered before knowing their model (bad JSON, unknown model...) ``""``. The label
set is therefore bounded by the fleet's models, never by client input.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class _Children:
    """``labels()`` remembered per call: prometheus_client checks the label names, converts
    the values and takes a lock on every call, and the router asks a dozen times per request for
    the same few children (every label set here is bounded, see the module docstring)."""

    def labels(self, *values: Any, **named: Any) -> Any:
        key = values or tuple(named.items())
        children: dict[tuple[Any, ...], Any] = self.__dict__.setdefault("_pdserve_children", {})
        child = children.get(key)
        if child is None:
            child = children[key] = super().labels(*values, **named)  # type: ignore[misc]
        return child


class Counter(_Children, prometheus_client.Counter):
    pass


class Gauge(_Children, prometheus_client.Gauge):
    pass


class Histogram(_Children, prometheus_client.Histogram):
    pass

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0, 300.0)


_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


_PHASE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


_LOOP_LAG_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    """The router's metric families, registered on ``registry``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests_total",
            "Requests answered by the router, by endpoint, HTTP status and served model.",
            ["endpoint", "status", "model_name"], registry=r)
        self.requests_received = Counter(
            "pdserve_router_requests_received_total",
            "Valid requests for a served model, counted on arrival (before admission control "
            "and placement): the arrival rate the autoscaler plans for. "
            "pdserve_router_requests_total counts answers, when they end.",
            ["endpoint", "model_name"], registry=r)
        self.request_duration = Histogram(
            "pdserve_router_request_duration_seconds",
            "Time from request arrival to the last byte sent to the client.",
            ["endpoint", "model_name"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "Time from request arrival to the first relayed token (streaming requests).",
            ["endpoint", "model_name"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Time between consecutive content chunks relayed to the client (streaming "
            "requests; one observation per chunk after the first).",
            ["model_name"], buckets=_ITL_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens_total",
            "Prompt tokens of completed answers, from the usage record the worker returned "
            "(non-streamed bodies; streams whose client asked for stream_options.include_usage).",
            ["model_name"], registry=r)
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens_total",
            "Generated tokens of completed answers, from the same usage records as "
            "pdserve_router_prompt_tokens_total.",
            ["model_name"], registry=r)
        self.prefill_duration = Histogram(
            "pdserve_router_prefill_duration_seconds",
            "Duration of the successful prefill call (max_tokens=1) on a prefill worker.",
            ["endpoint", "model_name"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.phase = Histogram(
            "pdserve_router_phase_seconds",
            "Duration of each router phase of a request: validate (parse, tokenize, hash), "
            "prefill_choose, prefill (the prefill call, retries included), decode_choose, "
            "decode_first_byte (decode call to its first byte), stream (first byte to the "
            "end); the phases of one request sum to its end-to-end time.",
            ["phase"], buckets=_PHASE_BUCKETS_S, registry=r)
        self.loop_lag = Histogram(
            "pdserve_router_event_loop_lag_seconds",
            "How long past its due time the router's event loop woke a probe that sleeps "
            "50 ms at a time: what anything holding the loop (a parse, a large body) added "
            "to every stream the router relayed meanwhile.",
            buckets=_LOOP_LAG_BUCKETS_S, registry=r)
        self.heap_frozen = Gauge(
            "pdserve_router_heap_frozen_objects",
            "Objects the router froze out of the collector's full passes after start-up and "
            "each tokenizer load (router.heap); 0: never settled.", registry=r)
        self.paths = Counter(
            "pdserve_router_paths_total",
            "Requests by the path they took: pd_first_token (P/D, the prefill's token streamed "
            "at once and the decode continuing from it), pd (classic P/D), decode_only "
            "(selective disaggregation skipped the prefill hop), aggregated (one plain worker), "
            "whole (the adaptive decision served it on one engine); reason says why (eligible, "
            "not_eligible, prefill_token_unusable, short_prompt, cached_on_decode, "
            "aggregated_worker; adaptive: whole_meets_slo, whole_misses_ttft, whole_misses_tpot, "
            "whole_harms_admitted, stall_sensitive, best_effort, forced, no_pd_pair).",
            ["path", "reason"], registry=r)
        self.path_cost_scale = Gauge(
            "pdserve_router_path_cost_scale",
            "The adaptive path decision's learned calibration: observed / assumed cost of a "
            "prefill (part=prefill) and of a decode step (part=decode); 1 = as configured.",
            ["part"], registry=r)
        self.in_flight = Gauge(
            "pdserve_router_in_flight_requests",
            "Requests dispatched to workers and not yet finished, by worker role.",
            ["role"], registry=r)
        self.upstream_errors = Counter(
            "pdserve_router_upstream_errors_total",
            "Failed upstream calls, by worker role and kind "
            "(connect, timeout, status, protocol, missing_kv_transfer_params).",
            ["role", "kind"], registry=r)
        self.upstream_retries = Counter(
            "pdserve_router_upstream_retries_total",
            "Upstream calls retried on another worker, by role.",
            ["role"], registry=r)
        self.kv_params_withdrawn = Counter(
            "pdserve_router_kv_params_withdrawn_total",
            "Decode retries sent without the prefill's kv_transfer_params because the failed "
            "attempt may have pulled and released them (the retry recomputes the prompt).",
            registry=r)
        self.unspent_kv_releases = Counter(
            "pdserve_router_unspent_kv_releases_total",
            "Prefill leases of requests that ended before a decode received their params, "
            "released through a decode (router.api.unspent), by outcome: released, refused, "
            "no_decode, failed, dropped (the last four leave the lease to expire).",
            ["outcome"], registry=r)
        self.migrations = Counter(
            "pdserve_router_migrations_total",
            "Client streams moved to another worker after the client got output (the new "
            "worker continues from the ids already sent), by what ended the old source: "
            "connect, timeout, protocol, status, error_event, truncated, stall.",
            ["reason"], registry=r)
        self.redispatches = Counter(
            "pdserve_router_redispatches_total",
            "Requests still queued in a worker's engine (no output yet) moved to a worker of "
            "their pool that could start them sooner (router.api.redispatch), by pool.",
            ["role"], registry=r)
        self.warm_requests = Counter(
            "pdserve_router_warm_requests_total",
            "One-token requests the router sent to warm the prefix cache of a worker that "
            "joined (router.api.warm), by the worker's role and outcome: ok, error.",
            ["role", "outcome"], registry=r)
        self.warm_tokens = Counter(
            "pdserve_router_warm_tokens_total",
            "Prompt tokens of those warm requests that were answered, by the worker's role.",
            ["role"], registry=r)
        self.warming_workers = Gauge(
            "pdserve_router_warming_workers",
            "Workers that joined and are being warmed now (router.api.warm): placement counts "
            "the warm requests as their load, so they take less traffic until this is 0.",
            ["role"], registry=r)
        self.migrations_refused = Counter(
            "pdserve_router_migrations_refused_total",
            "Client streams that ended with an error event although their worker failed "
            "mid-stream, by why they could not move: limit (--migration-limit reached), "
            "not_resumable (sampling that one engine must finish: stop strings, penalties, "
            "logprobs, seeds...), no_worker.",
            ["reason"], registry=r)
        self.routing_decisions = Counter(
            "pdserve_router_routing_decisions_total",
            "Placement decisions by worker role and reason (dualmap: cache_affinity, cache_holder, "
            "slo_switch, load, single_candidate; other policies: the policy's name).",
            ["role", "reason"], registry=r)
        self.rejected = Counter(
            "pdserve_router_rejected_requests_total",
            "Requests refused with 429 by admission control, by the pool that was full.",
            ["pool"], registry=r)
        self.limited = Counter(
            "pdserve_router_limited_requests_total",
            "Requests stopped by a per-key limit: concurrency (429 before routing), "
            "prefill_tokens or decode_tokens (429 before routing: the key's token rate) or "
            "deadline (the answer passed --answer-deadline-s).",
            ["reason"], registry=r)
        self.tokenizer_fallbacks = Counter(
            "pdserve_router_tokenizer_fallbacks_total",
            "Requests placed by their text because the router could not tokenize them (no "
            "tokenizer on the router host): context checks left to vLLM.", registry=r)
        self.workers = Gauge(
            "pdserve_router_workers",
            "Live workers in the router's membership view, by role.",
            ["role"], registry=r)
        self.load_scrape_failures = Counter(
            "pdserve_router_worker_load_scrape_failures_total",
            "Failed reads of a worker's /metrics for its load (vLLM's running/waiting/KV usage "
            "gauges), by worker role; such a worker is scored on router accounting alone.",
            ["role"], registry=r)
        self.kv_events = Counter(
            "pdserve_router_kv_events_total",
            "KV cache events received from the prefill engines (--kv-events), by kind: "
            "stored, removed, cleared; and anomalies: orphan (a stored block whose parent the "
            "router never saw, ignored), gap (a lost batch), undecodable, refused (an engine "
            "block size that is not a multiple of the router's 16 tokens).",
            ["kind"], registry=r)
        self.connections_closed = Counter(
            "pdserve_router_connections_closed_total",
            "Client connections the router closed on its own (router.http_protocol), by reason: "
            "head_timeout (request head not complete within --header-timeout-s: no answer), "
            "body_timeout (body not complete within --body-timeout-s: 408 when the router was "
            "reading it), head_too_large (a head over 64 KiB: 431).",
            ["reason"], registry=r)
        for reason in ("head_timeout", "body_timeout", "head_too_large"):
            self.connections_closed.labels(reason=reason)
        for role in ("prefill", "decode"):
            self.in_flight.labels(role=role).set(0)
            self.upstream_retries.labels(role=role)
            self.load_scrape_failures.labels(role=role)
            self.rejected.labels(pool=role)

    def render(self) -> bytes:
        return generate_latest(self.registry)
