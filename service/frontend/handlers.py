"""Register generated servicers with response serializers that also take WireMessage, and
request deserializers that turn unparsable bytes into a request the handler can refuse; every
method that takes one request refuses a call that does not carry exactly one."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.errors import InvalidInput, ServingError
from service.transport.wire import serializer_for


class Undecodable:
    """Stands in for a request whose bytes are not a valid message of the method's type.
    Handlers answer it with INVALID_ARGUMENT (a stream goes on) instead of gRPC's generic
    UNKNOWN, which would also end a whole stream for one bad message."""

    def __init__(self, expected: str, error: DecodeError) -> None:
        self.message = f"the request is not a valid {expected} message ({error})"

    def refuse(self, peer: str) -> ServingError:
        """The error the call (or the stream message) answers with; peer: who sent it."""
        return InvalidInput(self.message)


# Turns a message's bytes as they came (compressed or not) into the bytes to parse, or into
# the Undecodable that refuses it (service.frontend.compression).
Unpack = Callable[[bytes], "bytes | Undecodable"]


def _as_is(data: bytes) -> bytes | Undecodable:
    return data


def deserializer_for(
    parse: Callable[[bytes], Any], expected: str, unpack: Unpack = _as_is
) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        unpacked = unpack(data)
        if isinstance(unpacked, Undecodable):
            return unpacked
        try:
            return parse(unpacked)
        except DecodeError as err:
            return Undecodable(expected, err)

    return deserialize


class _Recorder:
    """Stands in for the server while generated add_*_to_server code registers its handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, Mapping[str, grpc.RpcMethodHandler]]] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below describe the same methods."""

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services.append((service, handlers))


def add_servicer(
    server: grpc.aio.Server,
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    unpack: Unpack = _as_is,
) -> None:
    """Like add_XServicer_to_server(servicer, server), with WireMessage-aware serializers;
    unpack inflates (or refuses) compressed requests before they are parsed."""

    def wire(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return _writing_its_answer(
            handler._replace(  # type: ignore[attr-defined]
                response_serializer=serializer_for(handler.response_serializer),
                request_deserializer=deserializer_for(
                    handler.request_deserializer,
                    _message_name(handler.request_deserializer),
                    unpack,
                ),
            )
        )

    _register(server, add_to_server, servicer, wire)


def add_taking_one_request(
    server: grpc.aio.Server, add_to_server: Callable[[Any, Any], None], servicer: Any
) -> None:
    """add_XServicer_to_server(servicer, server) for a servicer of gRPC's own (health): its
    one-request methods refuse calls that do not carry exactly one, and a message that is
    not a valid request INVALID_ARGUMENT (grpcio's answer is UNKNOWN, and a traceback in the
    log for every such call)."""

    def wire(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behaviour = handler.unary_unary or handler.unary_stream
        takes_one = inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)
        if handler.request_streaming or not takes_one:
            return handler  # not read by the_one_request: an Undecodable would reach it
        parse = handler.request_deserializer
        return handler._replace(  # type: ignore[attr-defined]
            request_deserializer=deserializer_for(parse, _message_name(parse))
        )

    _register(server, add_to_server, servicer, wire, refuse_undecodable=True)


def _register(
    server: grpc.aio.Server,
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    wire: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler],
    *,
    refuse_undecodable: bool = False,
) -> None:
    recorder = _Recorder()
    add_to_server(servicer, recorder)
    for service, handlers in recorder.services:
        wired = {
            method: taking_one_request(wire(handler), refuse_undecodable=refuse_undecodable)
            for method, handler in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wired),))
        server.add_registered_method_handlers(service, wired)


# A method that takes one request, called with none or with more (gRPC's "request cardinality
# violation"): INTERNAL, as gRPC's Go and Java servers answer it. grpcio hands the application
# no message that the body ended inside of, so a call cut short is one with none.
NO_REQUEST = (
    "the call ended without a whole request message (no message, or one cut short): "
    "this method takes exactly one"
)
MORE_THAN_ONE_REQUEST = "the call carried more than one request message: this method takes one"


async def the_one_request(
    context: grpc.aio.ServicerContext, *, refuse_undecodable: bool = False
) -> Any:
    """The call's request, once the client has half-closed after exactly one message; any
    other number ends the call INTERNAL. refuse_undecodable: one that is not a valid message
    ends it INVALID_ARGUMENT (else the handler gets the Undecodable, and refuses it itself)."""
    request = await context.read()
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INTERNAL, NO_REQUEST)
    if await context.read() is not grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INTERNAL, MORE_THAN_ONE_REQUEST)
    if refuse_undecodable and isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    return request


def taking_one_request(
    handler: grpc.RpcMethodHandler, *, refuse_undecodable: bool = False
) -> grpc.RpcMethodHandler:
    """A method that takes one request, registered as one that takes a stream of them: on the
    wire the same calls, but grpcio never answers a unary method's call whose body ends
    without a whole message (it waits until the client resets it), and answers one that
    carries two from the first. Streamed in, the handler sees every message and the end."""
    if handler.request_streaming:
        return handler
    if not handler.response_streaming:
        unary = handler.unary_unary
        if not inspect.iscoroutinefunction(unary):
            return handler  # not an asyncio handler: grpcio runs it as it is

        async def answer(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await unary(
                await the_one_request(context, refuse_undecodable=refuse_undecodable), context
            )

        return grpc.stream_unary_rpc_method_handler(
            answer,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    streamed = handler.unary_stream
    answers: Callable[[Any, grpc.aio.ServicerContext], Any]
    if inspect.isasyncgenfunction(streamed):

        async def generated(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for response in streamed(
                await the_one_request(context, refuse_undecodable=refuse_undecodable), context
            ):
                yield response

        answers = generated
    elif inspect.iscoroutinefunction(streamed):  # writes its answers with context.write

        async def written(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await streamed(
                await the_one_request(context, refuse_undecodable=refuse_undecodable), context
            )

        answers = written
    else:
        return handler
    return grpc.stream_stream_rpc_method_handler(
        answers,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _writing_its_answer(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A unary method that writes its one answer itself (rpc(holds_answer=True)) registered
    as unary-stream: on the wire the same call (one message each way, then the status), but
    only a write tells the handler whether its answer went out."""
    unary = handler.unary_unary
    if unary is None or not getattr(unary, "writes_answer", False):
        return handler
    return grpc.unary_stream_rpc_method_handler(
        unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _message_name(parse: Callable[[bytes], Any]) -> str:
    """AttendRequest for AttendRequest.FromString: what the error message names."""
    owner = getattr(parse, "__self__", None)
    return getattr(owner, "__name__", "request")
