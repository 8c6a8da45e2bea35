"""OpenTelemetry spans of the router (on when ``--otlp-traces-endpoint`` is given).

Each request gets one ``pdserve.request`` span; its trace context goes to the prefill and the
decode worker as a W3C ``traceparent`` header, so vLLM's own request spans (workers started with
the same ``--otlp-traces-endpoint``) land in the same trace. When the request ends, one child
span per router phase is added with the phase's exact start and end times. The exporter speaks
OTLP over gRPC, or over HTTP/protobuf when ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``
(the variable vLLM reads too).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from router.api.timeline import EVENTS, PHASES, PhaseClock

logger = logging.getLogger(__name__)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Starts, propagates and ends the spans of requests; a no-op without an endpoint."""

    def __init__(self, endpoint: str | None, service_name: str = "pdserve-router") -> None:
        self.endpoint = endpoint
        self._provider: Any = None
        self._tracer: Any = None
        if endpoint:
            self._setup(endpoint, service_name)

    def _setup(self, endpoint: str, service_name: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        exporter: Any
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=endpoint)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
            exporter = GrpcExporter(endpoint=endpoint, insecure=True)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("pdserve.router")
        logger.info("exporting request traces to %s (%s)", endpoint, protocol)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def begin(self, clock: PhaseClock, endpoint_name: str, headers: dict[str, str]) -> Any:
        """Open the request span (started at ``received``) and put its context in
        ``headers``; returns the span (None when tracing is off)."""
        if self._tracer is None:
            return None
        from opentelemetry import trace
        from opentelemetry.propagate import extract, inject

        span = self._tracer.start_span(
            "pdserve.request", context=extract(headers), start_time=_ns(clock.wall["received"]),
            attributes={"pdserve.request_id": clock.request_id,
                        "pdserve.upstream_id": clock.upstream_id,
                        "pdserve.endpoint": endpoint_name})
        inject(headers, context=trace.set_span_in_context(span))
        return span

    def end(self, span: Any, clock: PhaseClock, status: int) -> None:
        """Add one child span per phase reached and close the request span."""
        if span is None or self._tracer is None:
            return
        from opentelemetry import trace

        ctx = trace.set_span_in_context(span)
        previous = clock.wall["received"]
        for event in EVENTS[1:]:
            if event not in clock.wall:
                continue
            child = self._tracer.start_span(f"router.{PHASES[event]}", context=ctx,
                                            start_time=_ns(previous))
            child.end(end_time=_ns(max(previous, clock.wall[event])))
            previous = max(previous, clock.wall[event])
        span.set_attribute("http.response.status_code", status)
        if clock.path:
            span.set_attribute("pdserve.path", clock.path)
        for key, value in clock.plan.items():
            if value is not None:
                span.set_attribute(f"pdserve.plan.{key}", value)  # type: ignore[arg-type]
        if clock.moves:
            span.set_attribute("pdserve.moves", len(clock.moves))
            for move in clock.moves:
                span.add_event("pdserve.move", attributes={  # type: ignore[attr-defined]
                    k: v for k, v in move.items() if k != "at" and v is not None},
                    timestamp=_ns(float(move["at"])))  # type: ignore[arg-type]
        span.end(end_time=_ns(previous))

    def close(self) -> None:
        """Flush and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()
