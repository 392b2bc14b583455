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
import random
import re
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
# Where the spans of calls the gateway answered go, finished (it sampled and timed them):
# the provider's processor and exporter, with its resource and the tracer's scope.
_finished: Any = None


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


def _check_propagators() -> None:
    """OTEL_PROPAGATORS, refused at start when it names a propagator not installed: the
    API reads it when opentelemetry.propagate is first imported, and would fail that import,
    so every traced call, instead."""
    try:
        from opentelemetry import propagate  # noqa: F401
    except ValueError as err:
        from importlib.metadata import entry_points

        installed = sorted(e.name for e in entry_points(group="opentelemetry_propagator"))
        named = os.environ.get("OTEL_PROPAGATORS", "")
        raise TracingError(
            f"OTEL_PROPAGATORS={named!r}: {str(err).rstrip('.')}; the propagators installed "
            f"are {', '.join(installed)}"
        ) from None


def check(environ: Mapping[str, str] | None = None) -> None:
    """The OTEL_* variables start() would refuse (TracingError), checked without starting:
    the supervisor checks them before any model is loaded."""
    _protocol(os.environ if environ is None else environ)
    _check_propagators()


def start(*, max_queue_spans: int, environ: Mapping[str, str] | None = None) -> None:
    """Install the SDK's tracer provider with an OTLP exporter chosen by the OTEL_* variables."""
    global _tracer, _provider, _finished
    # Imported here: with tracing off the SDK costs neither import time nor memory.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    environ = os.environ if environ is None else environ
    protocol = _protocol(environ)
    _check_propagators()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        # The specification's switch for every signal: no spans, from any path (the REST
        # path's tracer was a no-op while the gateway's calls and streams were still made).
        log.info("--tracing on, but OTEL_SDK_DISABLED=true: no spans are made")
        return
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
    processor = BatchSpanProcessor(OTLPSpanExporter(), max_queue_size=max_queue_spans)
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)
    _finished = _Finished(processor, resource)
    log.info(
        "tracing on: OTLP %s to %s, sampler %s, at most %d spans queued",
        protocol,
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the exporter's default endpoint"),
        provider.sampler.get_description(),
        max_queue_spans,
    )


def stop(timeout_s: float) -> None:
    """Export what is queued, for at most timeout_s (an unreachable collector must not hold
    up the exit), then forget the provider."""
    global _tracer, _provider, _finished
    provider, _tracer, _provider, _finished = _provider, None, None, None
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
    """The current request's span ids, to submit with its embeddings; None when off, or
    when the span is not sampled (it is never exported: no batchmate may link to it)."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ids = trace.get_current_span().get_span_context()
    if not ids.is_valid or not ids.trace_flags.sampled:
        return None
    return Tag(ids.trace_id, ids.span_id, int(ids.trace_flags))


class _Finished:
    """Spans recorded elsewhere (by the gateway, which sampled and timed them), handed to the
    span processor as the SDK's finished spans: the same exporter, resource and scope as the
    tracer's, without a live span's bookkeeping (context, sampler, attribute checks: the
    attributes are ours and valid), which cost several times more per call."""

    def __init__(self, processor: Any, resource: Any) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.processor = processor
        self.resource = resource
        self.scope = InstrumentationScope(TRACER_NAME)

    def end(
        self,
        name: str,
        context: Any,
        parent: Any,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any],
        **more: Any,
    ) -> None:
        from opentelemetry.sdk.trace import ReadableSpan

        self.processor.on_end(
            ReadableSpan(
                name,
                context,
                parent,
                self.resource,
                dict(attributes),
                start_time=start_ns,
                end_time=end_ns,
                instrumentation_scope=self.scope,
                **more,
            )
        )


# The samplers OTEL_TRACES_SAMPLER names, as the SDK describes them.
_SAMPLER = re.compile(
    r"(?P<parent>ParentBased\{root:)?"
    r"(?:(?P<on>AlwaysOnSampler)|(?P<off>AlwaysOffSampler)|TraceIdRatioBased\{(?P<rate>[^}]*)\})"
    r"(?(parent),remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,"
    r"localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler\})"
)


def gateway_sampler() -> str:
    """The running sampler as the gateway's --trace-sampler takes it ('' when it is not one
    the gateway knows): [parentbased_](always_on|always_off|ratio:BOUND), BOUND being the
    SDK's own bound on a trace id's low 64 bits, so both sample exactly the same traces."""
    if _provider is None:
        return ""
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    found = _SAMPLER.fullmatch(_provider.sampler.get_description())
    if found is None:
        return ""
    prefix = "parentbased_" if found["parent"] else ""
    if found["on"] or found["off"]:
        return prefix + ("always_on" if found["on"] else "always_off")
    return f"{prefix}ratio:{TraceIdRatioBased.get_bound_for_rate(float(found['rate']))}"


@dataclass(frozen=True)
class Batch:
    """How the worker computed a call (its DONE): the times of its queue and compute spans."""

    queue_s: float
    compute_s: float
    started_at: float  # the batch's start, time.monotonic()
    batch_size: int
    padding: float
    batch_id: int
    tags: tuple[Tag, ...]  # the spans its compute span links to


@dataclass(frozen=True)
class GatewayCall:
    """A call the gateway answered and sampled: what its spans are made of."""

    trace_id: int
    span_id: int
    parent_span_id: int  # 0: none (the gateway started the trace)
    parent_flags: int
    trace_state: str
    name: str  # package.Service/Method
    received_ns: int  # wall clock
    answered_ns: int
    code: str  # gRPC status name
    error: bool  # a server-side failure
    attributes: Mapping[str, Any]
    batch: Batch | None  # when the worker computed the call


def record_gateway_call(call: GatewayCall) -> None:
    """The call's server span, with the ids the gateway gave it (the worker's batches link to
    them), and its queue and compute children, as the Python path makes them."""
    finished = _finished
    if finished is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    state = (
        trace.TraceState.from_header([call.trace_state]) if call.trace_state else trace.TraceState()
    )
    parent = None
    if call.parent_span_id:  # the gateway read it by the W3C propagator's rules
        parent = trace.SpanContext(
            call.trace_id,
            call.parent_span_id,
            is_remote=True,
            trace_flags=trace.TraceFlags(call.parent_flags),
            trace_state=state,
        )
    sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED)
    context = trace.SpanContext(
        call.trace_id, call.span_id, is_remote=False, trace_flags=sampled, trace_state=state
    )
    done = call.batch
    if done is not None:
        request = {
            key: call.attributes[key] for key in REQUEST_ATTRIBUTES if key in call.attributes
        }
        queue_s, started_at, compute_s = done.queue_s, done.started_at, done.compute_s
        started = _epoch_ns(started_at)
        batch = {
            **request,
            "attention.batch_size": done.batch_size,
            "attention.batch_padding_ratio": done.padding,
            "attention.batch_id": done.batch_id,
        }
        links = _links(done.tags)  # the batch's leader has them all, others one
        for name, start_ns, end_ns, attributes, more in (
            ("queue", _epoch_ns(started_at - queue_s), started, request, {}),
            ("compute", started, started + round(compute_s * 1e9), batch, {"links": links}),
        ):
            child = trace.SpanContext(
                call.trace_id, _span_id(), is_remote=False, trace_flags=sampled, trace_state=state
            )
            finished.end(name, child, context, start_ns, end_ns, attributes, **more)
    status = Status(StatusCode.ERROR, call.code) if call.error else Status(StatusCode.UNSET)
    finished.end(
        call.name,
        context,
        parent,
        call.received_ns,
        max(call.answered_ns, call.received_ns),
        {**call.attributes, "attention.code": call.code},
        kind=trace.SpanKind.SERVER,
        status=status,
    )


REQUEST_ATTRIBUTES = (
    "attention.model",
    "attention.model_version",
    "attention.sequences",
    "attention.sequence_length",
)


def _span_id() -> int:
    """A new span id, as the SDK's random id generator makes one."""
    while True:
        span_id = random.getrandbits(64)
        if span_id:
            return span_id


def _links(tags: Iterable[object]) -> list[Any]:
    from opentelemetry import trace

    return [
        trace.Link(trace.SpanContext(t.trace_id, t.span_id, True, trace.TraceFlags(t.trace_flags)))
        for t in tags
        if isinstance(t, Tag)
    ]


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
    links to the spans of the tags its batch gave it (the batch's leader: every traced
    request's; any other request: the leader's)."""
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
    compute = _tracer.start_span(
        "compute", start_time=started, links=_links(tags), attributes={**request, **batch}
    )
    compute.end(end_time=started + round(compute_s * 1e9))


def tag_numbers(tag: object) -> tuple[int, int, int] | None:
    """A Tag as the worker's control messages carry it (trace id, span id, flags), or None."""
    return (tag.trace_id, tag.span_id, tag.trace_flags) if isinstance(tag, Tag) else None


def tags_from_numbers(rows: Iterable[tuple[int, int, int]]) -> tuple[Tag, ...]:
    """The tags of a batch's requests, back from the worker (all front ends' requests)."""
    return tuple(Tag(*row) for row in rows)
