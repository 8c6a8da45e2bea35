"""A minimal OTLP/HTTP trace receiver for tests: the real exporters post protobuf to it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


def _value(value: object) -> object:
    """An OTLP ``AnyValue`` as the Python value it holds (string, bool, int or double)."""
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) for ``POST /v1/traces`` until ``close``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver._ingest(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _ingest(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out = []
        for rs in req.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    out.append(ReceivedSpan(
                        service, sp.name, sp.trace_id.hex(), sp.span_id.hex(),
                        sp.parent_span_id.hex(), sp.start_time_unix_nano, sp.end_time_unix_nano,
                        {a.key: _value(a.value) for a in sp.attributes}))
        with self._lock:
            self.spans.extend(out)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
