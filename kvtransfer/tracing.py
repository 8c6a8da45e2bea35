"""Connector phases as OpenTelemetry spans in the request's own trace.

When vLLM runs with ``--otlp-traces-endpoint``, it hands each request's ``traceparent`` header to
the scheduler (``Request.trace_headers``) and installs a tracer provider in its API server
process. The scheduler half ships that header with the timeline events; once a request's
connector chain is complete, :func:`emit_spans` adds one ``pdserve.kv.<role>`` span with a child
per phase, stamped with the phases' real start and end times, under the router's trace.
Without tracing in vLLM nothing is shipped and nothing is emitted.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtransfer.timeline import RequestTimeline


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def emit_spans(timeline: RequestTimeline, headers: Mapping[str, str]) -> None:
    """Emit ``timeline`` as spans whose parent is the context in ``headers``."""
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    tracer = trace.get_tracer("pdserve.kvtransfer")
    start = min(timeline.events.values())
    parent = tracer.start_span(f"pdserve.kv.{timeline.role}", context=extract(dict(headers)),
                               start_time=_ns(start),
                               attributes={"pdserve.vllm_request_id": timeline.request_id})
    ctx = trace.set_span_in_context(parent)
    at = start
    for name, seconds in timeline.phases.items():
        child = tracer.start_span(f"kv.{name}", context=ctx, start_time=_ns(at))
        child.end(end_time=_ns(at + seconds))
        at += seconds
    parent.end(end_time=_ns(at))
