"""The REST port's HTTP/1.1 connections: aiohttp's, with the gRPC port's timeouts, and with
what aiohttp answers by itself (a request its parser refuses, an Expect it does not take) in
the V2 JSON error body like every other REST error.

aiohttp's hooks for this: RequestHandler (one per connection) has keepalive_timeout (the idle
timeout), handle_error (the parser's refusals) and finish_response (every response), and
web.Server makes one per connection; an AppRunner makes the Server in _make_server, the
runners' extension point. There is no header timeout in aiohttp: RestProtocol arms its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from service.frontend.rest.codec import JSON_TYPE, error_response

log = logging.getLogger(__name__)

# The parser's bounds. The request target's is not the header field's, so that LineTooLong
# (which says only the limit it hit) tells a long URL (414) from a long header (431).
MAX_URL_BYTES = 4096  # V2 paths are short: a model name and a version
MAX_HEADER_FIELD_BYTES = 8190  # one header's name and value (aiohttp's default)
MAX_HEADERS = 128  # (aiohttp's default)
NEVER_S = 10 * 365 * 86400.0  # aiohttp's keep-alive timer has no "never" (0 closes at once)
TOO_MANY_HEADERS = "Too many headers received"  # aiohttp's message
TLS_ON_PLAIN = "Received HTTPS traffic on an HTTP port"  # aiohttp's message
# A request key: its answer closes the connection at once, its unread body never drained.
CLOSE_NOW = "attention.close_now"


@dataclass(frozen=True)
class ConnectionLimits:
    """The REST port's timeouts (0 = none), as --max-connection-idle-s and
    --http-header-timeout-s give them."""

    idle_s: float
    header_timeout_s: float


# The parser's refusals that say which rule was broken, each with a message of our own.
_BY_MESSAGE = {
    TOO_MANY_HEADERS: (431, f"the request has more than {MAX_HEADERS} headers"),
    TLS_ON_PLAIN: (400, "TLS sent to a plain-HTTP port; use http://, not https://"),
}
_BY_KIND: tuple[tuple[type[HttpProcessingError], int, str], ...] = (
    (BadHttpMethod, 400, "the request line has no valid method; expected e.g. POST /v2/..."),
    (BadStatusLine, 400, "the request line is malformed; expected METHOD /path HTTP/1.1"),
    (InvalidURLError, 400, "the request's target is not a valid URL"),
    (InvalidHeader, 400, "a request header has an invalid name or value"),
    (ContentEncodingError, 400, "the request's Content-Encoding is not gzip, deflate or br"),
)


def parser_refusal(exc: BaseException | None) -> tuple[int, str]:
    """The status and message for a request aiohttp's parser refused; never the request's own
    bytes (the parser's messages quote them)."""
    if not isinstance(exc, HttpProcessingError):
        return 500, "internal error in the HTTP layer; see the server log"
    if isinstance(exc, LineTooLong):
        if exc.args[1] == MAX_URL_BYTES:
            return 414, f"the request's URL is longer than {MAX_URL_BYTES} bytes"
        return (
            431,
            f"a request header (name and value) is longer than {MAX_HEADER_FIELD_BYTES} bytes",
        )
    if exc.message in _BY_MESSAGE:
        return _BY_MESSAGE[exc.message]
    for kind, status, message in _BY_KIND:
        if isinstance(exc, kind):
            return status, message
    # llhttp's reason (a fixed text, such as "Content-Length can't be present with
    # Transfer-Encoding"), before the quoted bytes that follow it.
    reason = exc.message.split(":\n", 1)[0].split("\n", 1)[0][:120]
    return 400, f"the request is not valid HTTP/1.1: {reason or 'malformed'}"


def _as_json(response: web.StreamResponse) -> web.Response:
    """A refusal aiohttp made by itself (text/plain) as a JSON error of the same status."""
    if response.status == 417:  # aiohttp's reply to an Expect other than 100-continue
        message = "the Expect header takes only 100-continue here; send that or none"
    else:
        message = f"{response.status} {response.reason}"
    converted = error_response(response.status, message)
    if not response.keep_alive:
        converted.force_close()
    return converted


class RestProtocol(RequestHandler):
    """One HTTP/1.1 connection of the REST port."""

    def __init__(self, manager: web.Server, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        # kwargs: the runner's (web.Server's) options; the connection's own bounds below are
        # the port's and win over any of them.
        options: dict[str, Any] = {
            **kwargs,
            "keepalive_timeout": limits.idle_s or NEVER_S,  # aiohttp's idle timeout
            "max_line_size": MAX_URL_BYTES,
            "max_field_size": MAX_HEADER_FIELD_BYTES,
            "max_headers": MAX_HEADERS,
            # No line per request (the request metrics count every call); None is how
            # aiohttp's runners turn it off.
            "access_log": None,
        }
        super().__init__(manager, **options)
        self._header_timeout_s = limits.header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None
        self._bytes_of_next_request = False
        self._next_started = False  # bytes of a pipelined request came (data_received)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()  # the first request's headers are due from the accept

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        if self._awaiting_headers():
            self._bytes_of_next_request = self._bytes_of_next_request or bool(data)
            if self._header_deadline is None:
                self._arm_header_deadline()  # a later request's headers: due from its first byte
            return
        if self._waiter_done():
            self._disarm_header_deadline()  # these bytes completed a request's headers
        # Bytes of a next request that came with or during this one (pipelined): its headers'
        # deadline starts when this one is answered (finish_response). Bytes after a request
        # with no body that end mid-headers are the next one's; a body's are not.
        if len(self._messages) > queued:
            last_payload = self._messages[-1][1]
            started = last_payload.is_eof() and not data.endswith(b"\r\n\r\n")
        else:
            current = self._current_request
            started = bool(data) and current is not None and current.content.is_eof()
        self._next_started = self._next_started or started

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if resp.status >= 400 and resp.content_type != JSON_TYPE:
            resp = _as_json(resp)
        try:
            answered = await super().finish_response(request, resp, start_time)
            compressed = request.headers.get("Content-Encoding", "identity") != "identity"
            if (compressed or request.get(CLOSE_NOW)) and not request.content.is_eof():
                # Never drain a compressed body the handler did not read: aiohttp's lingering
                # close reads and discards it for up to 10 s, inflating it on the event loop
                # (a few KB of brotli are GiBs of work). The connection closes after the
                # answer instead. (An unread plain body is drained: only copied, and its
                # client then reads the answer instead of a reset; unless the answer closes
                # the connection at once: CLOSE_NOW, as the 408 to a body that stopped coming.)
                log.debug("closed an HTTP connection after a body left unread")
                self.force_close()
            return answered
        finally:
            # A deadline belongs to the request it was armed for; the next one's starts with
            # its first byte (until then the idle timeout holds).
            self._disarm_header_deadline()
            self._bytes_of_next_request = False
            if self._next_started and not self._messages:
                # Part of the next request came already: its headers are due from now.
                self._next_started = False
                self._bytes_of_next_request = True
                self._arm_header_deadline()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's: too late for another response
            raise ConnectionError("the answer was being sent already; closing the connection")
        if isinstance(exc, HttpProcessingError):
            status, text = parser_refusal(exc)
            # A client's malformed request is no fault of ours: no traceback in the log.
            log.debug("refused a request the HTTP parser could not take: %s (%d)", text, status)
        else:
            log.error("error in the HTTP layer, answered %d", status, exc_info=exc)
            text = "internal error in the HTTP layer; see the server log"
        response = error_response(status, text)
        response.force_close()
        return response

    def _awaiting_headers(self) -> bool:
        """Whether the connection waits for a request whose headers have not all come (as
        aiohttp's own keep-alive check tells it: start() waits on _waiter)."""
        return self._waiter is not None and not self._waiter.done()

    def _waiter_done(self) -> bool:
        return self._waiter is not None and self._waiter.done()

    def _arm_header_deadline(self) -> None:
        if self._header_timeout_s > 0 and self._header_deadline is None:
            self._header_deadline = self._loop.call_later(
                self._header_timeout_s, self._headers_overdue
            )

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_overdue(self) -> None:
        self._header_deadline = None
        if not self._awaiting_headers() or self.transport is None:
            return  # a request is being served, or the connection is gone
        if self._bytes_of_next_request:
            message = (
                f"the request's headers did not all come within {self._header_timeout_s:g} s "
                "(--http-header-timeout-s); closing the connection"
            )
            body = json.dumps({"error": message}).encode()
            head = (
                "HTTP/1.1 408 Request Timeout\r\n"
                f"Content-Type: {JSON_TYPE}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        log.debug("closed an HTTP connection whose request headers were overdue")
        self.force_close()


class RestServer(web.Server):
    """aiohttp's Server, making a RestProtocol for each connection."""

    def __init__(self, app_server: web.Server, limits: ConnectionLimits) -> None:
        # The runner's options (app_server._kwargs: AppRunner(**kwargs) hands them to each
        # connection) go on to every RestProtocol, as web.Server's own __call__ does.
        super().__init__(
            app_server.request_handler,
            request_factory=app_server.request_factory,
            handler_cancellation=app_server.handler_cancellation,
            **app_server._kwargs,
        )
        self._limits = limits

    def __call__(self) -> RestProtocol:
        return RestProtocol(self, loop=self._loop, limits=self._limits, **self._kwargs)


class RestRunner(web.AppRunner):
    """An AppRunner whose server makes RestProtocol connections."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        # The app's own Server gives its handler and request factory (after the app's startup).
        return RestServer(await super()._make_server(), self._limits)
