"""A real OTLP/gRPC trace receiver for tests: decodes what the server's exporter sends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from bench.harness import poll_until


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: otlp.ExportTraceServiceRequest, context):
        self._receiver.add(request)
        return otlp.ExportTraceServiceResponse()


class OtlpReceiver:
    """Start with `with OtlpReceiver() as r:`; r.endpoint is what OTEL_EXPORTER_OTLP_ENDPOINT
    takes; r.spans(...) polls until a condition holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[trace_pb2.Span] = []
        self.service_names: set[str] = set()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, request: otlp.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                for attribute in resource_spans.resource.attributes:
                    if attribute.key == "service.name":
                        self.service_names.add(attribute.value.string_value)
                for scope in resource_spans.scope_spans:
                    self._spans.extend(scope.spans)

    def wait_for(
        self, done: Callable[[list[trace_pb2.Span]], bool], timeout_s: float = 20
    ) -> list[trace_pb2.Span]:
        return poll_until(
            self._received,
            done,
            what=lambda spans: f"spans received: {[s.name for s in spans]}",
            timeout_s=timeout_s,
        )

    def _received(self) -> list[trace_pb2.Span]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)


def attributes(span: trace_pb2.Span) -> dict[str, object]:
    """A span's attributes as plain values."""
    values: dict[str, object] = {}
    for item in span.attributes:
        kind = item.value.WhichOneof("value")
        values[item.key] = getattr(item.value, kind) if kind else None
    return values
