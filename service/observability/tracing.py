"""OpenTelemetry tracing (--tracing on): a server span per request, parented on the caller's
W3C traceparent, with its queue wait and compute as child spans made after the fact.

Off (the default) the SDK is never imported and every helper returns at its first line, so
requests pay one global lookup. On, spans go to a BatchSpanProcessor whose queue is bounded
(--tracing-max-queue-spans): the request path only appends to it, and when the exporter falls
behind (a slow or unreachable collector) new spans are dropped, never waited for. The exporter
and sampler are configured by the standard OTEL_* variables.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "http/protobuf"  # the OTLP exporter specification's default
TRACER_NAME = "attention-serving"

_tracer: Any = None  # opentelemetry.trace.Tracer while tracing is on
_provider: Any = None


class TracingError(ValueError):
    """An OTEL_* variable this server cannot use; the message says what was expected."""


@dataclass(frozen=True)
class Tag:
    """A request's span as plain numbers: travels through the batcher (and, later, between
    processes) so that a batch's compute span can link to every request it served."""

    trace_id: int
    span_id: int
    trace_flags: int


def enabled() -> bool:
    return _tracer is not None


def _protocol(environ: Mapping[str, str]) -> str:
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    ).strip()
    if protocol not in PROTOCOLS:
        raise TracingError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; expected one of "
            f"{', '.join(PROTOCOLS)}"
        )
    return protocol


def start(*, max_queue_spans: int, environ: Mapping[str, str] | None = None) -> None:
    """Install the SDK's tracer provider with an OTLP exporter chosen by the OTEL_* variables."""
    global _tracer, _provider
    # Imported here: with tracing off the SDK costs neither import time nor memory.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    environ = os.environ if environ is None else environ
    protocol = _protocol(environ)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    resource = Resource.create(
        {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": TRACER_NAME}
    )
    # No sampler given: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG itself.
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(), max_queue_size=max_queue_spans)
    )
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)
    log.info("tracing on: OTLP %s to %s, sampler %s, at most %d spans queued", protocol,
             environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the exporter's default endpoint"),
             provider.sampler.get_description(), max_queue_spans)  # fmt: skip


def stop(timeout_s: float) -> None:
    """Export what is queued, for at most timeout_s (an unreachable collector must not hold
    up the exit), then forget the provider."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is None:
        return
    closer = threading.Thread(target=provider.shutdown, daemon=True, name="tracing-shutdown")
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        log.warning("tracing: spans still unexported after %.1fs were dropped", timeout_s)


@dataclass
class RequestSpan:
    """A server span made current for the request's task; end() restores the previous one."""

    span: Any
    token: Any


def start_request(
    name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any] | None = None
) -> RequestSpan | None:
    """A SERVER span parented on the caller's traceparent in carrier (headers or metadata);
    None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import context, propagate, trace

    parent = propagate.extract(carrier)
    span = _tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER)
    if attributes:
        span.set_attributes(attributes)
    return RequestSpan(span, context.attach(trace.set_span_in_context(span, parent)))


def end_request(request: RequestSpan | None, code: str, *, error: bool, **attributes: Any) -> None:
    """Finish the span with its outcome (code: gRPC status name; error: a server-side
    failure, which marks the span's status ERROR)."""
    if request is None:
        return
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode

    span = request.span
    span.set_attributes({"attention.code": code, **attributes})
    if error:
        span.set_status(Status(StatusCode.ERROR, code))
    span.end()
    context.detach(request.token)


def current_tag() -> Tag | None:
    """The current request's span ids, to submit with its embeddings; None when off."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ids = trace.get_current_span().get_span_context()
    return Tag(ids.trace_id, ids.span_id, int(ids.trace_flags)) if ids.is_valid else None


def _epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant on the wall clock spans are stamped with."""
    return time.time_ns() - round((time.monotonic() - monotonic_s) * 1e9)


def record_batch(
    *,
    model: str,
    version: int,
    sequences: int,
    length: int,
    queue_s: float,
    compute_s: float,
    started_at: float,
    batch_size: int,
    padding: float,
    batch_id: int,
    tags: Iterable[object],
) -> None:
    """Queue and compute child spans of the current request, with explicit times; compute
    links to the span of every request its batch served."""
    if _tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    request: dict[str, Any] = {
        "attention.model": model,
        "attention.model_version": version,
        "attention.sequences": sequences,
        "attention.sequence_length": length,
    }
    current.set_attributes(request)
    batch: dict[str, Any] = {
        "attention.batch_size": batch_size,
        "attention.batch_padding_ratio": padding,
        "attention.batch_id": batch_id,
    }
    queued_at, started = _epoch_ns(started_at - queue_s), _epoch_ns(started_at)
    queue = _tracer.start_span("queue", start_time=queued_at, attributes=request)
    queue.end(end_time=started)
    links = [
        trace.Link(trace.SpanContext(t.trace_id, t.span_id, True, trace.TraceFlags(t.trace_flags)))
        for t in tags
        if isinstance(t, Tag)
    ]
    compute = _tracer.start_span(
        "compute", start_time=started, links=links, attributes={**request, **batch}
    )
    compute.end(end_time=started + round(compute_s * 1e9))


def tag_to_json(tag: object) -> list[int] | None:
    """A Tag as the worker's control messages carry it (plain numbers), or None."""
    return [tag.trace_id, tag.span_id, tag.trace_flags] if isinstance(tag, Tag) else None


def tags_from_json(rows: list[list[int]]) -> tuple[Tag, ...]:
    """The tags of a batch's requests, back from the worker (all front ends' requests)."""
    return tuple(Tag(int(r[0]), int(r[1]), int(r[2])) for r in rows if isinstance(r, list))
