"""The Open Inference Protocol over HTTP/REST (KServe V2, as Triton serves it): one more front
end on the V2Plane the gRPC servicer calls, so both answer alike.

aiohttp, because it is a mature asyncio-native HTTP/1.1 server: it runs on the gRPC server's
event loop (no ASGI layer, no thread hand-off), bounds a body while reading it
(client_max_size, compressed or chunked bodies too) and cancels the handler of a client that
went away (handler_cancellation), so the batcher drops its request before compute, as on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from service.catalog import SERVER_LABEL
from service.errors import ServingError
from service.frontend.delivery import AnswerBudget
from service.frontend.rest import routes
from service.frontend.restricted import Restrictions
from service.frontend.status import SERVER_FAULTS, code_for, http_status
from service.frontend.v2_plane import V2Plane
from service.observability import metrics, tracing

log = logging.getLogger(__name__)

API = "rest"  # the api label of its requests in the metrics
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# aiohttp's own refusals, as the gRPC code the same refusal would get (metrics, span status).
CODE_OF_HTTP = {
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,  # as gRPC counts a message above its limit
}


class HttpRefusal(Exception):
    """A refusal with its own HTTP status (a body too large: 413), not from the error table."""

    def __init__(self, status: int, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str) -> web.Response:
    """The V2 REST error body: {"error": "..."}."""
    return web.json_response({"error": message}, status=status)


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
        grace_period_s: float,
        restrictions: Restrictions | None = None,
        answers: AnswerBudget | None = None,
    ) -> None:
        self._plane = plane
        self.answers = answers  # None: answers are not bounded (tests of other parts)
        self._restrictions = restrictions or Restrictions()
        self.max_body_bytes = max_body_bytes
        self._grace_period_s = grace_period_s
        self._runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._wrap])
        routes.add_routes(app, self._plane, self)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Serve on host:port; the port bound (port 0 is never passed: 0 means off)."""
        runner = web.AppRunner(
            self.application(),
            handler_cancellation=True,
            access_log=None,  # the request metrics count every call; no line per request
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

    async def body(self, request: web.Request) -> bytes:
        """The request body, refused before it is read when it cannot be legal."""
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large(f"{declared} bytes")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:  # chunked or compressed, found while reading
            raise self._too_large("more bytes") from None

    def _too_large(self, sent: str) -> HttpRefusal:
        return HttpRefusal(
            413,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request body of {sent} is above this server's limit of {self.max_body_bytes} "
            "bytes (the largest legal request: --max-batch-size x --max-seq-len positions of "
            "the largest model); send fewer or shorter sequences per request",
        )

    @web.middleware
    async def _wrap(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every endpoint: errors as JSON with the table's status, metrics, a server span."""
        started = time.monotonic()
        code, status = grpc.StatusCode.OK, 200
        name = request.match_info.get("model")
        model = SERVER_LABEL if name is None else self._plane.registry.metric_label(name)
        in_flight = metrics.in_flight(API)
        in_flight.inc()
        span = self._start_span(request)
        try:
            if self._restrictions:
                # aiohttp's headers are case-insensitive; the check reads lower-case names.
                headers = {name.lower(): value for name, value in request.headers.items()}
                self._restrictions.check(group_of_path(request.path), headers)
            response = await handler(request)
            status = response.status
            if request.get(routes.UNDELIVERED):
                code, status = grpc.StatusCode.CANCELLED, 499  # the client went away
            return response
        except ServingError as err:
            code = code_for(err)
            status = http_status(code)
            return error_response(status, str(err))
        except HttpRefusal as err:
            code, status = err.code, err.status
            return error_response(status, str(err))
        except web.HTTPException as err:  # aiohttp's: no such route or method
            code, status = CODE_OF_HTTP.get(err.status, grpc.StatusCode.UNKNOWN), err.status
            return error_response(status, _refusal_message(request, err))
        except asyncio.CancelledError:
            code, status = grpc.StatusCode.CANCELLED, 499  # the client went away
            raise
        except Exception:
            code, status = grpc.StatusCode.INTERNAL, 500
            request_id = uuid.uuid4().hex[:12]
            log.exception("internal error in %s %s request_id=%s", API, _route(request),
                          request_id)  # fmt: skip
            return error_response(
                status, f"internal error; request_id={request_id} is in the server log"
            )
        finally:
            tracing.end_request(
                span,
                code.name,
                error=code in SERVER_FAULTS,
                **{"http.response.status_code": status},
            )
            in_flight.dec()
            metrics.requests_counter(model, API, code.name).inc()
            metrics.request_duration(model, API).observe(time.monotonic() - started)

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
            "[/ready|/config|/stats|/infer], /v2/models/stats, /v2/repository/... and "
            "/v2/systemsharedmemory/..."
        )
    if err.status == 405:
        return f"{request.method} is not served on {request.path[:200]!r}; {err.reason}"
    return err.reason


def group_of_path(path: str) -> str:
    """The --restricted-api group of a REST path, as Triton groups its HTTP endpoints."""
    parts = [part for part in path.split("/") if part]
    if parts[:2] == ["v2", "health"] or parts[-1:] == ["ready"]:
        return "health"
    if parts[:2] == ["v2", "repository"]:
        return "model-repository"
    if parts[:2] == ["v2", "systemsharedmemory"] or parts[:2] == ["v2", "cudasharedmemory"]:
        return "shared-memory"
    last = parts[-1] if parts else ""
    return {"infer": "inference", "stats": "statistics", "config": "model-config"}.get(
        last, "metadata"
    )
