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
from service.errors import DeadlineExpired, ServingError
from service.frontend import caller
from service.frontend.delivery import MEMORY_PER_ANSWER_BYTE, AnswerBudget, Reservation
from service.frontend.handlers import Undecodable
from service.frontend.status import SERVER_FAULTS, code_for
from service.observability import logs, metrics, tracing
from service.observability.metrics import Api
from service.status_texts import DEADLINE_EXCEEDED, INTERNAL_ERROR
from service.text import shown
from service.transport.wire import WireMessage

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")


class Labeled(Protocol):
    """A servicer that can name the model and request id of a request (for metrics/logs)."""

    def model_label(self, request: Any) -> str: ...

    def request_id(self, request: Any) -> str: ...


class HoldsAnswers(Labeled, Protocol):
    """A servicer whose answers count against the undelivered-answers budget."""

    answers: AnswerBudget | None

    def answer_bytes(self, request: Any) -> int: ...


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
# Span names as OpenTelemetry's gRPC conventions write them: package.Service/Method.
SERVICE_OF_API = {
    Api.ATTENTION: "attention.v1.AttentionService",
    Api.ATTENTION_STREAM: "attention.v1.AttentionService",
    Api.V2: "inference.GRPCInferenceService",
    Api.V2_STREAM: "inference.GRPCInferenceService",
}

STREAM_METHOD_OF_API = {Api.ATTENTION_STREAM: "AttendStream", Api.V2_STREAM: "ModelStreamInfer"}


def internal_error(request_id: str) -> tuple[str, str]:
    """An unexpected error's request id as it is logged (the request's, shown, or a new one)
    and the status message that names it (the gateway words the worker's alike)."""
    logged = shown(request_id or uuid.uuid4().hex[:12])
    return logged, INTERNAL_ERROR.format(request_id=logged)


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
    if span is None:
        return  # tracing off (or this call not traced)
    tracing.end_request(
        span, code.name, error=code in SERVER_FAULTS, **{"rpc.grpc.status_code": code.value[0]}
    )


def serialized(response: Any) -> WireMessage:
    """The response as bytes now, so the request's duration includes its serialization
    (gRPC's serializer then only hands the one chunk on)."""
    if isinstance(response, WireMessage):
        return response if len(response.chunks) == 1 else WireMessage([response.serialize()])
    return WireMessage([response.SerializeToString(deterministic=True)])


async def _end_with(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str, holds_answer: bool
) -> None:
    """End the call with code and details. A method that writes its own answer ends by
    returning with the status set, raising nothing: context.abort's AbortError, chained to the
    error being handled, took part in a reference cycle with the request's frames (the
    request, its slab region and future), which only the full garbage collection freed
    (measured: the front end held 110-170 MiB of refused requests after a 3x overload)."""
    if holds_answer:
        context.set_code(code)
        context.set_details(details)
        return
    await context.abort(code, details)


def rpc(api: str, *, holds_answer: bool = False) -> Callable[[Handler], Handler]:
    """Decorate a servicer method; clients see our messages, never a traceback.

    holds_answer: the answer is reserved in the servicer's AnswerBudget from admission until
    gRPC has taken it, and counted OK only then. Such a method writes its one answer itself
    (handlers.add_servicer registers it as unary-stream, the same calls on the wire): only a
    write tells when an answer went out, or that it never will."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.monotonic()
            answered: float | None = None
            code = grpc.StatusCode.OK
            model = self.model_label(request)
            in_flight = metrics.in_flight(api)
            in_flight.inc()
            span = start_span(api, handler.__name__, context)
            reservation: Reservation | None = None
            tally = _Tally(model, api)
            # What this call logs carries its request id (JSON logs).
            id_token = logs.REQUEST_ID.set(self.request_id(request))
            try:
                reservation = _admit(self, request, context, holds_answer=holds_answer)
                response = serialized(await handler(self, request, context))
                answered = time.monotonic()
                if not holds_answer:
                    return response
                code = await _deliver(context, response, reservation)
                return None
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN  # the handler chose it
                raise
            except ServingError as err:
                code = code_for(err)
                tally.count(code)
                details = self.error_details(err, context)
                del err  # see _end_with
                await _end_with(context, code, details, holds_answer)
            except asyncio.CancelledError:
                remaining = context.time_remaining()
                expired = ended_at_deadline(remaining)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                raise
            except Exception:
                request_id, details = internal_error(self.request_id(request))
                code = grpc.StatusCode.INTERNAL
                log.exception(
                    "internal error in %s/%s request_id=%s", api, handler.__name__, request_id
                )
                tally.count(code)
                await _end_with(context, code, details, holds_answer)
            finally:
                # Server time until the answer existed: a slow reader does not stretch it.
                ended = answered if answered is not None else time.monotonic()
                if log.isEnabledFor(logging.DEBUG):  # a line per call only when verbose
                    # Within the span still: the line carries its trace and span ids.
                    log.debug(
                        "%s %s ended %s after %.6f s",
                        api,
                        handler.__name__,
                        code.name,
                        ended - started,
                    )
                end_span(span, code)
                in_flight.dec()
                if reservation is not None:
                    reservation.release()
                tally.count(code)
                metrics.request_duration(model, api).observe(ended - started)
                logs.REQUEST_ID.reset(id_token)

        wrapped.writes_answer = holds_answer  # type: ignore[attr-defined]
        return wrapped

    return decorate


class _Tally:
    """Counts a call once: before an abort sends its status (a client that has seen the
    status must find the call counted), else when the handler ends."""

    def __init__(self, model: str, api: str) -> None:
        self._model, self._api, self._done = model, api, False

    def count(self, code: grpc.StatusCode) -> None:
        if not self._done:
            self._done = True
            metrics.requests_counter(self._model, self._api, code.name).inc()


async def _deliver(
    context: grpc.aio.ServicerContext, response: WireMessage, reservation: Reservation | None
) -> grpc.StatusCode:
    """Write the one answer: OK once gRPC took it, CANCELLED when the call ended first (the
    client reset it or closed its connection: gRPC cancels this task, or the write fails),
    DEADLINE_EXCEEDED when its deadline ended it (a client that did not read the answer)."""
    if reservation is not None:
        reservation.resize(MEMORY_PER_ANSWER_BYTE * response.nbytes)  # the real size now
    try:
        await context.write(response)
    except asyncio.CancelledError:
        raise
    except Exception as err:
        log.debug("the call ended before its answer was written: %r", err)
        if ended_at_deadline(context.time_remaining()):
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


def _admit(
    servicer: HoldsAnswers, request: Any, context: grpc.aio.ServicerContext, *, holds_answer: bool
) -> Reservation | None:
    """Refuse a call already past its deadline (whatever its message, as the gateway does),
    then what could not be decoded; reserve the answer's memory when it holds one."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExpired(DEADLINE_EXCEEDED)
    if isinstance(request, Undecodable):
        raise request.refuse(caller.peer(context))
    if not holds_answer or servicer.answers is None:
        return None
    try:
        estimate = servicer.answer_bytes(request)
    except Exception:  # a malformed request: the handler says what is wrong with it
        estimate = 0
    return servicer.answers.reserve(caller.peer(context), MEMORY_PER_ANSWER_BYTE * estimate)
