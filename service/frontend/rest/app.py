"""The Open Inference Protocol over HTTP/REST (KServe V2, as Triton serves it): one more front
end on the V2Plane the gRPC servicer calls, so both answer alike.

aiohttp, because it is a mature asyncio-native HTTP/1.1 server: it runs on the gRPC server's
event loop (no ASGI layer), bounds a body while reading it (client_max_size, compressed or
chunked bodies too) and cancels the handler of a client that went away (handler_cancellation),
so the batcher drops its request before compute, as on gRPC. What would hold the loop for long
(JSON of millions of numbers, copying a large answer) runs on one codec thread, in pieces that
let the loop take the GIL back every few milliseconds (service/frontend/rest/pieces.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, ContentLengthError, TransferEncodingError
from aiohttp.web_protocol import RequestPayloadError

from service.catalog import SERVER_LABEL
from service.errors import ServingError
from service.frontend.delivery import AnswerBudget
from service.frontend.rest import routes
from service.frontend.rest.codec import HEADER_LENGTH, error_response, json_length
from service.frontend.rest.pieces import INLINE_BYTES
from service.frontend.rest.protocol import CLOSE_NOW, ConnectionLimits, RestRunner
from service.frontend.restricted import Restrictions
from service.frontend.status import SERVER_FAULTS, code_for, http_status
from service.frontend.v2_plane import V2Plane
from service.observability import logs, metrics, tracing
from service.observability.metrics import Api
from service.status_texts import INTERNAL_ERROR
from service.text import shown

log = logging.getLogger(__name__)
T = TypeVar("T")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# aiohttp's own refusals, as the gRPC code the same refusal would get (metrics, span status).
CODE_OF_HTTP = {
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,  # as gRPC counts a message above its limit
}


class HttpRefusal(Exception):
    """A refusal with its own HTTP status (a body too large: 413), not from the error table;
    close: the connection cannot serve another request (its body is unreadable)."""

    def __init__(
        self, status: int, code: grpc.StatusCode, message: str, *, close: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.close = status, code, close


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


class RestFrontend:
    """start() binds and serves; stop() closes within its timeout."""

    def __init__(
        self,
        plane: V2Plane,
        *,
        max_body_bytes: int,
        max_json_request_bytes: int,
        max_json_answer_bytes: int,
        connections: ConnectionLimits,
        grace_period_s: float,
        restrictions: Restrictions | None = None,
        answers: AnswerBudget | None = None,
    ) -> None:
        self._plane = plane
        self.answers = answers  # None: answers are not bounded (tests of other parts)
        self._restrictions = restrictions or Restrictions()
        self.max_body_bytes = max_body_bytes
        self.max_json_request_bytes = max_json_request_bytes
        self.max_json_answer_bytes = max_json_answer_bytes
        self._connections = connections
        self._grace_period_s = grace_period_s
        self._runner: web.AppRunner | None = None
        # One thread: big JSON is decoded or encoded one request at a time, so the memory of
        # that work is one request's, and the event loop competes with one thread for the GIL.
        self._codec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rest-codec")

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._wrap])
        routes.add_routes(app, self._plane, self)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Serve on host:port; the port bound (port 0 is never passed: 0 means off)."""
        runner = RestRunner(
            self.application(),
            self._connections,
            handler_cancellation=True,
            shutdown_timeout=self._grace_period_s,
        )
        await runner.setup()
        # reuse_port: every front-end process serves the one HTTP port (the supervisor has
        # checked that no other server holds it).
        site = web.TCPSite(
            runner, host, port, ssl_context=ssl_context, reuse_address=True, reuse_port=True
        )
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        return int(runner.addresses[0][1])

    async def stop(self, timeout_s: float) -> None:
        """Stop listening, let handlers still running finish, for at most timeout_s."""
        if self._runner is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._runner.cleanup(), timeout=timeout_s)
        self._codec.shutdown(wait=False, cancel_futures=True)

    async def off_loop(
        self, nbytes: int, work: Callable[[], T], then: Callable[[], None] | None = None
    ) -> T:
        """work(), on the codec thread when it handles more than INLINE_BYTES (nbytes), else
        here; then() after it on the event loop, also when this call is cancelled first
        (work may still be reading what then() frees)."""
        if nbytes <= INLINE_BYTES:
            try:
                return work()
            finally:
                if then is not None:
                    then()
        job = self._codec.submit(work)
        if then is not None:
            loop = asyncio.get_running_loop()
            job.add_done_callback(lambda _: _call_soon(loop, then))
        try:
            return await asyncio.wrap_future(job)
        finally:
            # An exception raised by work is held by job, and its traceback holds this frame:
            # a reference cycle that kept the frames' locals (a decoded body of hundreds of
            # MiB) alive until a full collection. Without job the exception goes with its
            # answer.
            del job

    async def body(self, request: web.Request, *, binary_follows: bool = False) -> bytes:
        """The request body, refused before it is read when it cannot be legal. Its JSON (all
        of it, or when binary_follows the Inference-Header-Content-Length bytes it declares)
        is bounded apart."""
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large(f"{declared} bytes")
        # The JSON's length; None where Inference-Header-Content-Length is no byte count
        # (decode_infer refuses it, saying so).
        spelled = request.headers.get(HEADER_LENGTH) if binary_follows else None
        header = None if spelled is None else json_length(spelled)
        json_declared = declared if spelled is None else header
        if header is not None and declared is not None and header > declared:
            raise HttpRefusal(
                400,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{HEADER_LENGTH} is {header}; expected the JSON's length in bytes, at most "
                f"the body's {declared}",
            )
        if json_declared is not None and json_declared > self.max_json_request_bytes:
            raise self._json_too_large(json_declared)
        try:
            raw = await self._read_while_it_comes(request)
        except web.HTTPRequestEntityTooLarge:  # chunked or compressed, found while reading
            raise self._too_large("more bytes") from None
        except RequestPayloadError as err:
            raise HttpRefusal(
                400, grpc.StatusCode.INVALID_ARGUMENT, _unreadable(request, err), close=True
            ) from None
        sent = len(raw) if spelled is None else min(header or 0, len(raw))
        if sent > self.max_json_request_bytes:
            raise self._json_too_large(sent)
        return raw

    async def _read_while_it_comes(self, request: web.Request) -> bytes:
        """request.read(), refused with 408 (and the connection closed) once no byte of the
        body came for --http-header-timeout-s: a body declared and never sent held its
        connection and handler for ever."""
        timeout_s = self._connections.header_timeout_s
        if timeout_s <= 0 or request.content.is_eof():  # (no body: aiohttp's empty reader)
            return await request.read()
        reading = asyncio.ensure_future(request.read())
        try:
            loop = asyncio.get_running_loop()
            seen, since = -1, loop.time()
            while not reading.done():
                await asyncio.wait({reading}, timeout=timeout_s / 4)
                now, came = loop.time(), getattr(request.content, "total_raw_bytes", 0)
                if came != seen:
                    seen, since = came, now
                elif now - since >= timeout_s and not reading.done():
                    raise HttpRefusal(
                        408,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no byte of the request's body came for {timeout_s:g} s "
                        "(--http-header-timeout-s); closing the connection",
                        close=True,
                    )
            return reading.result()
        finally:
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reading
            elif not reading.cancelled():
                # Taken, so never logged as unretrieved: a client that went mid-body (the
                # read failed as this handler was cancelled) is no error of this server's.
                reading.exception()

    def _too_large(self, sent: str) -> HttpRefusal:
        return HttpRefusal(
            413,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request body of {sent} is above this server's limit of {self.max_body_bytes} "
            "bytes (the largest legal request: --max-batch-size x --max-seq-len positions of "
            "the largest model); send fewer or shorter sequences per request",
        )

    def _json_too_large(self, nbytes: int) -> HttpRefusal:
        return HttpRefusal(
            413,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the request's JSON is {nbytes} bytes, above this server's bound of "
            f"{self.max_json_request_bytes} bytes for JSON (--max-json-request-bytes); send "
            "tensors as binary data after the JSON (Triton's binary tensor extension: "
            f"binary_data_size on each input, {HEADER_LENGTH} the JSON's length; "
            "tritonclient.http: set_data_from_numpy(array, binary_data=True))",
        )

    @web.middleware
    async def _wrap(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every endpoint: errors as JSON with the table's status, metrics, a server span."""
        started = time.monotonic()
        code, status = grpc.StatusCode.OK, 200
        name = request.match_info.get("model")
        model = SERVER_LABEL if name is None else self._plane.registry.metric_label(name)
        in_flight = metrics.in_flight(Api.REST)
        in_flight.inc()
        span = self._start_span(request)
        id_token = logs.REQUEST_ID.set("")  # the infer endpoint sets it once it has one
        try:
            self._check_access(request)
            _check_transfer_coding(request)
            response = await handler(request)
            status = response.status
            if request.get(routes.UNDELIVERED):
                code, status = grpc.StatusCode.CANCELLED, 499  # the client went away
            return response
        except ServingError as err:
            code = code_for(err)
            status = http_status(code)
            return error_response(status, self._message(request, err))
        except HttpRefusal as err:
            code, status = err.code, err.status
            refusal = error_response(status, str(err))
            if err.close:
                refusal.force_close()
                request[CLOSE_NOW] = True
            return refusal
        except web.HTTPException as err:  # aiohttp's: no such route or method
            code, status = CODE_OF_HTTP.get(err.status, grpc.StatusCode.UNKNOWN), err.status
            refusal = error_response(status, _refusal_message(request, err))
            if "Allow" in err.headers:  # a 405's methods served (RFC 9110 requires it)
                refusal.headers["Allow"] = err.headers["Allow"]
            return refusal
        except asyncio.CancelledError:
            code, status = grpc.StatusCode.CANCELLED, 499  # the client went away
            raise
        except Exception:
            code, status = grpc.StatusCode.INTERNAL, 500
            request_id = shown(uuid.uuid4().hex[:12])  # worded as gRPC's (rpc.internal_error)
            log.exception(
                "internal error in %s %s request_id=%s", Api.REST, _route(request), request_id
            )
            return error_response(status, INTERNAL_ERROR.format(request_id=request_id))
        finally:
            tracing.end_request(
                span,
                code.name,
                error=code in SERVER_FAULTS,
                **{"http.response.status_code": status},
            )
            in_flight.dec()
            metrics.requests_counter(model, Api.REST, code.name).inc()
            elapsed = time.monotonic() - started
            metrics.request_duration(model, Api.REST).observe(elapsed)
            if log.isEnabledFor(logging.DEBUG):  # a line per request only when verbose
                log.debug(
                    "%s %s ended %d after %.6f s",
                    request.method,
                    shown(_route(request), 200),
                    status,
                    elapsed,
                )
            logs.REQUEST_ID.reset(id_token)

    def _check_access(self, request: web.Request) -> None:
        """--restricted-api: the matched route's group needs its key. A path no route serves
        has no group: its 404 or 405 names no model."""
        group = routes.group_of(request)
        if self._restrictions and group is not None:
            self._restrictions.check(group, _lower_case(request.headers))

    def _message(self, request: web.Request, err: ServingError) -> str:
        """err's message; an unknown model's without the models served (which catalog lists)
        for a caller without the metadata group's key, where that group is restricted."""
        if routes.group_of(request) == "model-repository":  # its key shows the index
            return str(err)
        return self._restrictions.details(err, _lower_case(request.headers))

    @staticmethod
    def _start_span(request: web.Request) -> Any:
        if not tracing.enabled():
            return None
        route = _route(request)
        return tracing.start_request(
            f"{request.method} {route}",
            request.headers,  # type: ignore[arg-type]  # a case-insensitive multidict
            {"http.request.method": request.method, "http.route": route, "url.path": request.path},
        )


def _refusal_message(request: web.Request, err: web.HTTPException) -> str:
    if err.status == 404:
        return (
            f"no endpoint {request.method} {request.path[:200]!r}; the V2 REST API serves "
            "/v2, /v2/health/{live,ready}, /v2/models/{model}[/versions/{version}]"
            "[/ready|/config|/stats|/infer], /v2/models/stats, /v2/repository/..., "
            "/v2/systemsharedmemory/..., /v2/cudasharedmemory/... (501) and /v2/logging"
        )
    if err.status == 405:
        return f"{request.method} is not served on {request.path[:200]!r}; {err.reason}"
    return err.reason


def _lower_case(headers: Mapping[str, str]) -> dict[str, str]:
    """aiohttp's case-insensitive headers as the restriction check reads them."""
    return {name.lower(): value for name, value in headers.items()}


def _call_soon(loop: asyncio.AbstractEventLoop, then: Callable[[], None]) -> None:
    """then() on loop, from the codec thread; nothing once the loop has closed (shutdown)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(then)


def _check_transfer_coding(request: web.Request) -> None:
    """Chunked is the one transfer coding read (RFC 9112: 501 for another): the HTTP parser
    reads the chunks of "gzip, chunked" and would hand on their gzip bytes as the body."""
    codings = ",".join(request.headers.getall("Transfer-Encoding", ())).split(",")
    others = [c for c in map(str.strip, codings) if c and c.lower() != "chunked"]
    if others:
        raise HttpRefusal(
            501,
            grpc.StatusCode.UNIMPLEMENTED,
            f"Transfer-Encoding {shown(', '.join(others))} is not supported; send the body "
            "chunked or with a Content-Length, compressed by Content-Encoding (gzip, deflate "
            "or br) if at all",
            close=True,  # its body, unread, is still on the connection
        )


def _unreadable(request: web.Request, err: RequestPayloadError) -> str:
    """What is wrong with a body aiohttp could not read (never the body's bytes)."""
    cause = err.__cause__
    if isinstance(cause, ContentEncodingError):
        encoding = shown(request.headers.get("Content-Encoding", ""))
        return (
            f"the request body does not decode as its Content-Encoding {encoding} says; send "
            "it uncompressed, or compressed as the header says (gzip, deflate or br)"
        )
    if isinstance(cause, TransferEncodingError):
        return "the request body's chunked Transfer-Encoding is malformed"
    if isinstance(cause, ContentLengthError):
        return "the request body ended before its Content-Length"
    return "the request body could not be read as HTTP/1.1 framing says"
