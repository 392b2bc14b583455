"""Wraps every RPC handler: error -> status mapping, request metrics, request-id logging."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from service.dataplane import ended_at_deadline
from service.errors import InvalidInput, ServingError
from service.frontend.handlers import Undecodable
from service.frontend.status import SERVER_FAULTS, code_for
from service.observability import metrics, tracing
from service.text import shown
from service.transport.wire import WireMessage

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")


class Labeled(Protocol):
    """A servicer that can name the model and request id of a request (for metrics/logs)."""

    def model_label(self, request: Any) -> str: ...

    def request_id(self, request: Any) -> str: ...


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
# Span names as OpenTelemetry's gRPC conventions write them: package.Service/Method.
SERVICE_OF_API = {
    "attention": "attention.v1.AttentionService",
    "attention_stream": "attention.v1.AttentionService",
    "v2": "inference.GRPCInferenceService",
    "v2_stream": "inference.GRPCInferenceService",
}

STREAM_METHOD_OF_API = {"attention_stream": "AttendStream", "v2_stream": "ModelStreamInfer"}


def start_span(api: str, method: str, context: grpc.aio.ServicerContext) -> Any:
    """The call's server span, parented on a traceparent in its metadata; None when off."""
    if not tracing.enabled():
        return None
    metadata = {item.key: item.value for item in context.invocation_metadata() or ()}
    service = SERVICE_OF_API.get(api, api)
    return tracing.start_request(
        f"{service}/{method}",
        metadata,
        {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
    )


def end_span(span: Any, code: grpc.StatusCode) -> None:
    tracing.end_request(
        span, code.name, error=code in SERVER_FAULTS, **{"rpc.grpc.status_code": code.value[0]}
    )


def serialized(response: Any) -> WireMessage:
    """The response as bytes now, so the request's duration includes its serialization
    (gRPC's serializer then only hands the one chunk on)."""
    if isinstance(response, WireMessage):
        return response if len(response.chunks) == 1 else WireMessage([response.serialize()])
    return WireMessage([response.SerializeToString()])


def rpc(api: str) -> Callable[[Handler], Handler]:
    """Decorate a servicer method; clients see our messages, never a traceback."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapped(self: Labeled, request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.monotonic()
            code = grpc.StatusCode.OK
            model = self.model_label(request)
            in_flight = metrics.in_flight(api)
            in_flight.inc()
            span = start_span(api, handler.__name__, context)
            try:
                if isinstance(request, Undecodable):
                    raise InvalidInput(request.message)
                return serialized(await handler(self, request, context))
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN  # the handler chose it
                raise
            except ServingError as err:
                code = code_for(err)
                await context.abort(code, str(err))
            except asyncio.CancelledError:
                remaining = context.time_remaining()
                expired = ended_at_deadline(remaining)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                raise
            except Exception:
                request_id = shown(self.request_id(request) or uuid.uuid4().hex[:12])
                code = grpc.StatusCode.INTERNAL
                log.exception(
                    "internal error in %s/%s request_id=%s", api, handler.__name__, request_id
                )
                await context.abort(
                    code, f"internal error; request_id={request_id} is in the server log"
                )
            finally:
                end_span(span, code)
                in_flight.dec()
                metrics.requests_counter(model, api, code.name).inc()
                metrics.request_duration(model, api).observe(time.monotonic() - started)

        return wrapped

    return decorate
