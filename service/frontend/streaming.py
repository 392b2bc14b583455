"""Bidirectional streams: many requests on one call, each answered in completion order.

One reader task reads the stream, one task per request runs the same path as the unary call
(so streamed and unary requests share the batcher), and the handler itself is the only
writer, so responses never interleave. At most max_inflight requests of a stream are
unanswered at a time; past that the reader stops reading and HTTP/2 flow control holds the
client back (back-pressure, never an error). When the call ends early (the client cancels or
goes away, or its deadline passes), every outstanding task is cancelled, and the batcher drops
their queued requests before compute. On shutdown (StreamCloser.close_all) a stream stops
reading, answers every request it has read, and ends with UNAVAILABLE, so the client knows
to send the rest elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from service.dataplane import ended_at_deadline
from service.errors import AnswersBacklogged, ServingError
from service.frontend import caller
from service.frontend.delivery import MEMORY_PER_ANSWER_BYTE, AnswerBudget, Reservation
from service.frontend.handlers import Undecodable
from service.frontend.rpc import (
    STREAM_METHOD_OF_API,
    end_span,
    internal_error,
    serialized,
    start_span,
)
from service.frontend.status import code_for
from service.observability import logs, metrics
from service.status_texts import DEADLINE_EXCEEDED, NOT_ACCEPTING, STREAM_CLOSED

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")


@dataclass(frozen=True)
class StreamCalls(Generic[Request, Response]):
    """What one API plugs into the stream machinery."""

    api: str  # metrics label of each streamed request, e.g. "attention_stream"
    answer: Callable[[Request, grpc.aio.ServicerContext], Awaitable[Response]]  # unary path
    failure: Callable[[Request, grpc.StatusCode, str], Response]  # one message's error reply
    model_label: Callable[[Request], str]
    request_id: Callable[[Request], str]
    closer: StreamCloser | None = None  # the server's, so shutdown can end open streams
    # Bytes the answer to a request will hold, estimated before it is computed: the stream
    # reserves them when it reads the request, and reads no more past max_pending_bytes.
    answer_bytes: Callable[[Request], int] | None = None
    # The server-wide bound on undelivered answers: each message's estimate is reserved in it
    # too, from reading until written; a message that does not fit is answered
    # RESOURCE_EXHAUSTED at once (the stream goes on).
    answers: AnswerBudget | None = None
    # A refused message's text for this caller (Restrictions.details: an unknown model's
    # without the models served, to a caller not allowed to list them).
    details: Callable[[ServingError, grpc.aio.ServicerContext], str] = lambda err, _: str(err)


DEFAULT_PENDING_BYTES = 64 << 20  # the --max-stream-pending-bytes default


class StreamCloser:
    """Every open stream of a server, so that shutdown can end them all."""

    def __init__(self) -> None:
        self.refusing = False
        self._streams: set[_Stream[Any, Any]] = set()

    def add(self, stream: _Stream[Any, Any]) -> None:
        self._streams.add(stream)

    def discard(self, stream: _Stream[Any, Any]) -> None:
        self._streams.discard(stream)

    def refuse_new(self) -> None:
        """The drain stopped taking work: a stream opened from now on is refused at once."""
        self.refusing = True

    def close_all(self) -> None:
        self.refusing = True
        for stream in list(self._streams):
            stream.close()


async def serve_stream(
    calls: StreamCalls[Request, Response],
    requests: AsyncIterator[Request],
    context: grpc.aio.ServicerContext,
    *,
    max_inflight: int,
    max_pending_bytes: int = DEFAULT_PENDING_BYTES,
) -> None:
    """Answer every request of the stream; return (status OK) once the client has half-closed
    and every answer is written, or end with UNAVAILABLE once the server shuts down, or with
    DEADLINE_EXCEEDED when the call's deadline passed first (its messages may have been
    answered DEADLINE_EXCEEDED before gRPC's own timer ended the call: it ends so all the
    same, as it does when the timer comes first)."""
    # The gateway's part of a stream it took is the gateway's to end in the drain, and to log.
    part = caller.is_stream_part(context)
    closer = None if part else calls.closer
    started = time.monotonic()
    stream: _Stream[Request, Response] | None = None
    code = grpc.StatusCode.OK
    try:
        if closer is not None and closer.refusing:  # none of its requests was read: none taken
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_ACCEPTING)
        stream = _Stream(calls, context, max_inflight, max_pending_bytes)
        await _run(stream, requests, closer, context)
        if stream.call_ended:
            code = _ended_by_client_or_deadline(context)
    except grpc.aio.AbortError:
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except asyncio.CancelledError:
        code = _ended_by_client_or_deadline(context)
        raise
    finally:
        if not part and log.isEnabledFor(logging.DEBUG):  # one line a call, when verbose
            log.debug(
                "%s %s ended %s after %.6f s, %s",
                calls.api,
                STREAM_METHOD_OF_API[calls.api],
                code.name,
                time.monotonic() - started,
                requests_read(0 if stream is None else stream.requests_read),
            )


def requests_read(count: int) -> str:
    """'1 request read', '3 requests read': a stream's end line, worded as the gateway's."""
    return f"{count} request read" if count == 1 else f"{count} requests read"


def _ended_by_client_or_deadline(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    if ended_at_deadline(context.time_remaining()):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


async def _run(
    stream: _Stream[Any, Any],
    requests: AsyncIterator[Any],
    closer: StreamCloser | None,
    context: grpc.aio.ServicerContext,
) -> None:
    if closer is not None:
        closer.add(stream)
    try:
        await stream.run(requests)
    finally:
        if closer is not None:
            closer.discard(stream)
    if stream.closed:
        await context.abort(grpc.StatusCode.UNAVAILABLE, STREAM_CLOSED)
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)


class _CallEnded(Exception):
    """A write found the call already over."""


class _Stream(Generic[Request, Response]):
    def __init__(
        self,
        calls: StreamCalls[Request, Response],
        context: grpc.aio.ServicerContext,
        max_inflight: int,
        max_pending_bytes: int,
    ) -> None:
        self._calls = calls
        self._context = context
        self._slots = asyncio.Semaphore(max_inflight)  # released once an answer is written
        # Answers read but not yet taken by the client, in estimated bytes: past the bound
        # the stream reads no more, so a client that does not read cannot pile up memory.
        self._max_pending_bytes = max_pending_bytes
        self._reserved_bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        # An answer, its reservations and how to count it; None is the reader's last word.
        self._answers: asyncio.Queue[_Answer | None] = asyncio.Queue()
        self._peer = caller.peer(context)
        self._writing: _Answer | None = None
        self._ended = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight = metrics.in_flight(calls.api)  # bound once per stream
        self._reader: asyncio.Task[None] | None = None
        self._reading = False
        self.closed = False
        self.requests_read = 0
        self.call_ended = False  # a write found the call over

    def close(self) -> None:
        """Stop reading; answers to what was read still go out, then the call ends."""
        self.closed = True
        if self._reader is not None and self._reading:
            self._reader.cancel()  # only while reading: answers already underway go on

    async def run(self, requests: AsyncIterator[Request]) -> None:
        reader = asyncio.create_task(self._read(requests), name=f"{self._calls.api}-reader")
        self._reader = reader
        try:
            while (item := await self._answers.get()) is not None:
                self._writing = item  # settled in finally when the call ends mid-write
                await self._write(item.answer)
                self._writing = None
                item.settle(delivered=True)
                self._reserve(-item.reserved)
                self._slots.release()
            if not self.closed:
                await reader  # already done; raises if reading the stream failed
        except _CallEnded:
            self.call_ended = True
            return  # the client cancelled, went away or ran out of time: no one left to tell
        except Exception:
            log.exception("%s: reading or writing the stream failed", self._calls.api)
            await self._context.abort(grpc.StatusCode.INTERNAL, "internal error in the stream")
        finally:
            # Normally nothing is left; after a cancel or a failure this drops every request
            # of this stream still queued in the batcher.
            self._ended = True  # answers finished from now on are settled, not queued
            reader.cancel()
            for task in self._tasks:
                task.cancel()
            try:
                await asyncio.gather(reader, *self._tasks, return_exceptions=True)
            finally:  # gRPC may cancel this task again while it waits
                self._abandon_unwritten()

    def _abandon_unwritten(self) -> None:
        """Answers computed but never written: counted CANCELLED (DEADLINE_EXCEEDED once the
        stream's deadline has come), their bytes given back."""
        expired = self._expired()
        if self._writing is not None:
            self._writing.settle(delivered=False, expired=expired)
            self._writing = None
        while not self._answers.empty():
            item = self._answers.get_nowait()
            if item is not None:
                item.settle(delivered=False, expired=expired)

    def _expired(self) -> bool:
        return ended_at_deadline(self._context.time_remaining())

    async def _read(self, requests: AsyncIterator[Request]) -> None:
        try:
            try:
                await self._read_all(requests)
            except asyncio.CancelledError:
                if not self.closed:
                    raise
            # Half-closed by the client, or closed by shutdown: answer what was read.
            while self._tasks:
                await asyncio.wait(set(self._tasks))
        finally:
            self._answers.put_nowait(None)

    async def _read_all(self, requests: AsyncIterator[Request]) -> None:
        self._reading = True
        try:
            await self._read_until_closed(requests)
        finally:
            self._reading = False

    async def _read_until_closed(self, requests: AsyncIterator[Request]) -> None:
        while not self.closed:
            await self._slots.acquire()  # back-pressure: read only when a slot is free
            await self._room.wait()  # ... and while unwritten answers stay under the bound
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return  # the client half-closed: finish what it sent
            self.requests_read += 1
            reserved = self._estimate(request)
            self._reserve(reserved)
            hold, refusal = self._hold(reserved)
            task = asyncio.create_task(self._answer(request, reserved, hold, refusal))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if hold is not None:  # a task cancelled before it ran has no except to release it
                task.add_done_callback(functools.partial(_release_if_cancelled, hold))

    async def _write(self, answer: Any) -> None:
        try:
            await self._context.write(answer)
        except Exception as err:
            # Answers are serialized already, so a write fails only once the call has ended;
            # grpc reports the cancellation to this handler a moment later.
            log.debug(
                "%s: the call ended before an answer could be written: %r", self._calls.api, err
            )
            raise _CallEnded from err

    def _estimate(self, request: Request) -> int:
        estimate = self._calls.answer_bytes
        if estimate is None or isinstance(request, Undecodable):
            return 0
        try:
            return estimate(request)
        except Exception:  # a malformed request: its answer is an error message
            return 0

    def _hold(self, nbytes: int) -> tuple[Reservation | None, AnswersBacklogged | None]:
        """nbytes in the server's budget, or the refusal the message is answered with."""
        if self._calls.answers is None:
            return None, None
        try:
            memory = MEMORY_PER_ANSWER_BYTE * nbytes  # the budget counts memory, as unary calls
            return self._calls.answers.reserve(self._peer, memory), None
        except AnswersBacklogged as err:
            return None, err

    def _reserve(self, change: int) -> None:
        self._reserved_bytes += change
        if self._reserved_bytes >= self._max_pending_bytes:
            self._room.clear()
        else:
            self._room.set()

    async def _answer(
        self,
        request: Request,
        reserved: int,
        hold: Reservation | None,
        refusal: AnswersBacklogged | None,
    ) -> None:
        calls = self._calls
        started = time.monotonic()
        code = grpc.StatusCode.OK
        self._inflight.inc()
        model = calls.model_label(request)
        # What this message logs carries its request id (this task's own context: no reset).
        logs.REQUEST_ID.set(calls.request_id(request))
        # A span per message: a stream may live for hours, and its messages are the requests.
        span = start_span(calls.api, STREAM_METHOD_OF_API.get(calls.api, "stream"), self._context)
        try:
            if isinstance(request, Undecodable):
                raise request.refuse(self._peer)
            if refusal is not None:
                raise refusal
            answer: Any = await calls.answer(request, self._context)
        except ServingError as err:
            code = code_for(err)
            answer = calls.failure(request, code, calls.details(err, self._context))
        except asyncio.CancelledError:
            self._reserve(-reserved)  # no answer will be written
            remaining = self._context.time_remaining()
            expired = ended_at_deadline(remaining)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            request_id, details = internal_error(calls.request_id(request))
            log.exception("internal error in %s request_id=%s", calls.api, request_id)
            answer = calls.failure(request, code, details)
        else:
            answer = serialized(answer)  # inside the request's measured time
        finally:
            end_span(span, code)
            self._inflight.dec()
            if code != grpc.StatusCode.OK:  # OK is counted once written (or not)
                metrics.requests_counter(model, calls.api, code.name).inc()
            metrics.request_duration(model, calls.api).observe(time.monotonic() - started)
        computed = _Answer(answer, reserved, hold, model, calls.api, code)
        if self._ended:
            computed.settle(delivered=False, expired=self._expired())  # nobody left to write it
        else:
            self._answers.put_nowait(computed)


def _release_if_cancelled(hold: Reservation, task: asyncio.Task[None]) -> None:
    if task.cancelled():
        hold.release()


@dataclass
class _Answer:
    """One computed answer waiting to be written, with what it holds."""

    answer: Any
    reserved: int  # in the stream's own bound
    hold: Reservation | None  # in the server's budget
    model: str
    api: str
    code: grpc.StatusCode

    def settle(self, *, delivered: bool, expired: bool = False) -> None:
        """Written (or never will be): give the bytes back; an OK answer counts now (one
        never written CANCELLED, DEADLINE_EXCEEDED when the stream's deadline ended it, as a
        unary call's)."""
        if self.hold is not None:
            self.hold.release()
            self.hold = None
        if self.code == grpc.StatusCode.OK:
            code = grpc.StatusCode.OK
            if not delivered:
                code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            metrics.requests_counter(self.model, self.api, code.name).inc()
