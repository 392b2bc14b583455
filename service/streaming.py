"""Bidirectional streams: many requests on one call, each answered in completion order.

One reader task reads the stream, one task per request runs the same path as the unary call
(so streamed and unary requests share the batcher), and the handler itself is the only
writer, so responses never interleave. At most max_inflight requests of a stream are
unanswered at a time; past that the reader stops reading and HTTP/2 flow control holds the
client back (back-pressure, never an error). When the call ends early (the client cancels or
goes away, or its deadline passes), every outstanding task is cancelled, and the batcher drops
their queued requests before compute.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from service import metrics
from service.errors import ServingError
from service.status import code_for
from service.text import shown

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


async def serve_stream(
    calls: StreamCalls[Request, Response],
    requests: AsyncIterator[Request],
    context: grpc.aio.ServicerContext,
    *,
    max_inflight: int,
) -> None:
    """Answer every request of the stream; return (status OK) once the client has half-closed
    and every answer is written."""
    await _Stream(calls, context, max_inflight).run(requests)


_END = object()  # the reader's last word: no more answers will come


class _Stream(Generic[Request, Response]):
    def __init__(
        self,
        calls: StreamCalls[Request, Response],
        context: grpc.aio.ServicerContext,
        max_inflight: int,
    ) -> None:
        self._calls = calls
        self._context = context
        self._slots = asyncio.Semaphore(max_inflight)  # released once an answer is written
        self._answers: asyncio.Queue[object] = asyncio.Queue()  # holds <= max_inflight
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight = metrics.in_flight(calls.api)  # bound once per stream

    async def run(self, requests: AsyncIterator[Request]) -> None:
        reader = asyncio.create_task(self._read(requests), name=f"{self._calls.api}-reader")
        try:
            while (answer := await self._answers.get()) is not _END:
                await self._context.write(answer)
                self._slots.release()
            await reader  # already done; raises if reading the stream failed
        except Exception:
            log.exception("%s: reading or writing the stream failed", self._calls.api)
            await self._context.abort(grpc.StatusCode.INTERNAL, "internal error in the stream")
        finally:
            # Normally nothing is left; after a cancel or a failure this drops every request
            # of this stream still queued in the batcher.
            reader.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(reader, *self._tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[Request]) -> None:
        try:
            while True:
                await self._slots.acquire()  # back-pressure: read only when a slot is free
                try:
                    request = await anext(requests)
                except StopAsyncIteration:
                    break  # the client half-closed: finish what it sent
                task = asyncio.create_task(self._answer(request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.wait(set(self._tasks))
        finally:
            self._answers.put_nowait(_END)

    async def _answer(self, request: Request) -> None:
        calls = self._calls
        started = time.monotonic()
        code = grpc.StatusCode.OK
        self._inflight.inc()
        try:
            answer = await calls.answer(request, self._context)
        except ServingError as err:
            code = code_for(err)
            answer = calls.failure(request, code, str(err))
        except asyncio.CancelledError:
            remaining = self._context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            request_id = shown(calls.request_id(request) or uuid.uuid4().hex[:12])
            log.exception("internal error in %s request_id=%s", calls.api, request_id)
            answer = calls.failure(
                request, code, f"internal error; request_id={request_id} is in the server log"
            )
        finally:
            self._inflight.dec()
            model = calls.model_label(request)
            metrics.requests_counter(model, calls.api, code.name).inc()
            metrics.request_duration(model, calls.api).observe(time.monotonic() - started)
        self._answers.put_nowait(answer)
