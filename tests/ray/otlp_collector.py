"""A small OTLP/HTTP trace collector on 127.0.0.1 that hands what it receives to an in-memory exporter.

Session actors export their spans with OpenTelemetry's own ``OTLPSpanExporter``
(the exporter docs/telemetry.md recommends on Ray) to this collector, which
decodes each ``ExportTraceServiceRequest`` back into SDK spans and passes them
to an ``InMemorySpanExporter``: a test reads the spans of every process of the
cluster, and of its own, in one place. Each span's resource keeps the
attributes its process set (``process.pid``, the Ray node id).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _context(trace_id: bytes, span_id: bytes) -> SpanContext:
    return SpanContext(int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"), is_remote=True,
                       trace_flags=TraceFlags(1))


def decode(body: bytes) -> list[ReadableSpan]:
    """The spans of one OTLP/protobuf export request, as SDK spans."""
    request = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in request.resource_spans:
        resource = Resource(_attrs(rs.resource.attributes))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReadableSpan(
                    name=s.name, context=_context(s.trace_id, s.span_id),
                    parent=_context(s.trace_id, s.parent_span_id) if s.parent_span_id else None,
                    resource=resource, attributes=_attrs(s.attributes),
                    links=[Link(_context(lk.trace_id, lk.span_id), _attrs(lk.attributes)) for lk in s.links],
                    kind=SpanKind(max(s.kind - 1, 0)), start_time=s.start_time_unix_nano,
                    end_time=s.end_time_unix_nano,
                    status=Status(StatusCode.ERROR if s.status.code == 2 else StatusCode.UNSET)))
    return out


class Collector:
    """Serves ``POST /v1/traces`` on 127.0.0.1 until closed; what arrives goes to ``exporter``."""

    def __init__(self, exporter: InMemorySpanExporter | None = None) -> None:
        self.exporter = exporter or InMemorySpanExporter()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector.exporter.export(decode(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-collector", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
