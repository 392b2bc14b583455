"""The worker's end of the channels: one FrontendLink per connected front end, reading its
requests from that front end's slab and writing answers back into it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, cast

import numpy as np

from service.errors import InvalidInput, ServingError, ShuttingDown
from service.ipc import channel, messages
from service.ipc.records import (
    Call,
    Cancel,
    ClientTensor,
    Done,
    ErrorText,
    Fail,
    InferRequest,
    Message,
    Reply,
    Sync,
    Synced,
    ToFrontend,
    TraceTag,
)
from service.ipc.slab import Slab, embedding_bytes
from service.values import check_finite, in_model_dtype
from service.worker.batching.batcher import Batcher, Result, Target, Ticket
from service.worker.client_regions import ClientRegions, RegionWriter
from service.worker.engine.onnx_model import OnnxModel

log = logging.getLogger(__name__)
SYNC_TIMEOUT_S = 5.0
# An input in a client's region up to this size is read on the loop, in the turn that got
# its INFER (tens of microseconds); a larger one on the reader thread, the loop free meanwhile.
INLINE_READ_BYTES = 256 << 10

# Answers a front end's control call: its op and arguments -> a JSON value.
ControlCall = Callable[[str, dict[str, Any]], Awaitable[Any]]


class FrontendLink:
    """One front end: its slab, its requests in flight, its control calls."""

    def __init__(
        self,
        name: str,
        slab: Slab,
        *,
        resolve: Callable[[str], OnnxModel],
        batcher: Batcher,
        call: ControlCall,
        regions: ClientRegions | None = None,
        region_reader: Executor | None = None,
    ) -> None:
        self.name = name
        self._client_regions = regions  # client shared memory; None when off
        self._region_reader = region_reader  # reads client regions' inputs (None: the default)
        self._reading: dict[int, asyncio.Future[np.ndarray]] = {}  # id -> its input's read
        self._slab = slab
        self._writer: channel.Writer | None = None  # once connected (connection_made)
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._resolve = resolve
        self._batcher = batcher
        self._call = call
        self._submitted: dict[int, Ticket] = {}  # id -> its place in the batcher
        self._gone = False  # the front end went: answers are dropped, not sent
        self._tasks: set[asyncio.Task[None]] = set()
        # INFERs read from this link so far, and their embeddings' bytes: published in the
        # slab's header for the front end's edge refusals.
        self._read_requests = 0
        self._read_bytes = 0
        self._syncs: dict[int, asyncio.Future[None]] = {}
        self._lone = False  # the read being dispatched holds one message
        self._sync_ids = itertools.count(1)

    def send(self, message: ToFrontend) -> None:
        if self._writer is not None:
            self._writer.send(message)

    def protocol(self) -> asyncio.Protocol:
        """The protocol that reads this front end's socket: each message is dispatched in
        the loop turn that read it, with no task between the socket and the batcher."""
        return _Incoming(self)

    async def sync(self, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Return once every request this front end sent before it read the latest served
        set has arrived here (messages on one socket stay in order); a gone front end, or
        one that does not answer in time, counts as synced."""
        sync_id = next(self._sync_ids)
        waiter = self._syncs[sync_id] = asyncio.get_running_loop().create_future()
        self.send(Sync(sync_id))
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            log.warning("front end %s did not answer a sync in %.0fs", self.name, timeout_s)
        finally:
            self._syncs.pop(sync_id, None)

    async def serve(self) -> None:
        """Serve until the front end goes; then drop what it still had queued."""
        try:
            await self._closed
        finally:
            self._gone = True
            self._reading.clear()  # read ones are dropped, unanswered: nobody is listening
            for ticket in list(self._submitted.values()):
                # Queued ones are dropped; a computing batch still writes into the slab,
                # whose mapping outlives the descriptor (the views hold it).
                self._batcher.withdraw(ticket)
            for waiter in self._syncs.values():
                if not waiter.done():
                    waiter.set_result(None)  # nothing more can arrive from it
            if self._writer is not None:
                self._writer.close()
            self._slab.close()

    def _connected(self, transport: asyncio.WriteTransport) -> None:
        self._writer = channel.Writer(transport)

    def _received(self, received: list[Message]) -> None:
        self._note_read(received)
        # A lone request may compute at once; requests read together batch together.
        self._lone = len(received) == 1
        try:
            for message in received:
                self._dispatch(message)
        finally:
            self._lone = False
        self._batcher.run_due()  # every request of this read queued: batch them now
        if self._writer is not None:
            self._writer.flush()  # answers and refusals of this read leave now

    def _note_read(self, received: list[Message]) -> None:
        """Count the INFERs of this read before queueing them: a front end's edge check then
        never counts one twice (unread, and in the queue), at worst neither for a moment."""
        requests, nbytes = 0, 0
        for message in received:
            if isinstance(message, InferRequest):
                requests += 1
                with contextlib.suppress(TypeError, ValueError):  # malformed: refused later
                    nbytes += embedding_bytes(message.shape, message.dtype)
        if requests:
            self._read_requests += requests
            self._read_bytes += nbytes
            self._slab.note_read(self._read_requests, self._read_bytes)

    def _lost(self, error: BaseException | None) -> None:
        if self._closed.done():
            return
        if isinstance(error, ValueError):
            log.error("front end %s sent a malformed control message: %s", self.name, error)
        else:
            log.info("front end %s disconnected", self.name)
        self._closed.set_result(None)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, InferRequest):
            self._submit(message)
        elif isinstance(message, Cancel):
            self._withdraw(message.request_id)
        elif isinstance(message, Call):
            self._start(self._control(message))
        elif isinstance(message, Synced):
            waiter = self._syncs.pop(message.sync_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        else:
            raise ValueError(f"the worker is not sent {type(message).__name__} messages")

    def _start(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _submit(self, message: InferRequest) -> None:
        """Queue one request now, in the turn that read it: a CANCEL read in the same turn
        then finds it (and drops it before it is computed). The batch writes the
        answer straight into the front end's regions (or the client's); the DONE that
        follows tells it so. An input in a client's region is read first: a small one here,
        a large one on the reader thread (it would hold this loop, and every front end's
        requests, for milliseconds); a CANCEL meanwhile drops that once read."""
        request_id = message.request_id
        read: Callable[[bool], np.ndarray] | None = None  # a large input, read on the thread
        try:
            model = self._resolve(message.model_key)
            dtype = np.dtype(message.dtype)
            shape = message.shape
            if len(shape) != 3:
                raise ValueError(f"shape {shape} is not [n, seq, d]")
            if message.input_ref is not None:
                reader, nbytes = self._client_input(message.input_ref, shape, model)
                if nbytes <= INLINE_READ_BYTES:
                    embeddings = reader(True)
                else:
                    read = reader
            else:
                embeddings = self._slab.array(_offset(message.input_offset, "input"), shape, dtype)
        except ServingError as err:
            self._fail(request_id, err)
            return
        except (KeyError, TypeError, ValueError, OSError) as err:
            log.error(
                "request %d from front end %s could not be read: %s", request_id, self.name, err
            )
            self._fail(request_id, err)
            return
        if read is None:
            self._queue(request_id, message, model, embeddings)
            return
        reading = asyncio.get_running_loop().run_in_executor(self._region_reader, read, False)
        self._reading[request_id] = reading
        reading.add_done_callback(functools.partial(self._read, request_id, message, model))

    def _read(
        self,
        request_id: int,
        message: InferRequest,
        model: OnnxModel,
        reading: asyncio.Future[np.ndarray],
    ) -> None:
        if self._reading.pop(request_id, None) is None:
            return  # cancelled (and answered) while it was read, or the front end went
        if reading.cancelled():  # the worker is stopping
            self._fail(request_id, ShuttingDown("the server stopped before computing it"))
            return
        error = reading.exception()
        if error is None:
            self._queue(request_id, message, model, reading.result())
            return
        if not isinstance(error, ServingError):
            log.error(
                "reading request %d's input from client shared memory failed: %r", request_id, error
            )
        self._fail(request_id, error)

    def _queue(
        self, request_id: int, message: InferRequest, model: OnnxModel, embeddings: np.ndarray
    ) -> None:
        """Enqueue with the answer's targets: the front end's slab, or a client's region."""
        writers: list[RegionWriter] = []
        n, seq, _ = shape = embeddings.shape
        dtype = np.dtype(message.dtype)
        with_weights = message.with_weights
        weights_shape = (n, model.spec.num_heads, seq, seq)
        try:
            output = self._target(
                message.output_ref, message.output_offset, "output", shape, dtype, writers
            )
            weights = (
                self._target(
                    message.weights_ref,
                    message.weights_offset,
                    "weights",
                    weights_shape,
                    np.dtype("f4"),
                    writers,
                )
                if with_weights
                else None
            )
            answer = functools.partial(self._answer, request_id, writers)
            if self._lone and self._batcher.run_alone(
                model,
                embeddings,
                answer,
                with_weights=with_weights,
                deadline=message.deadline,
                tag=message.tag,
                into=(output, weights),
            ):
                return  # computed and answered
            ticket = self._batcher.queue(
                model,
                embeddings,
                answer,
                with_weights=with_weights,
                deadline=message.deadline,
                tag=message.tag,
                into=(output, weights),
            )
        except (ServingError, KeyError, TypeError, ValueError) as err:  # queue full, ...
            self._close(writers)
            if not isinstance(err, ServingError):
                log.error(
                    "front end %s sent a malformed request %d: %s", self.name, request_id, err
                )
            self._fail(request_id, err)
            return
        self._submitted[request_id] = ticket

    def _target(
        self,
        ref: ClientTensor | None,
        offset: int | None,
        name: str,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        writers: list[RegionWriter],
    ) -> Target:
        """Where one answer goes: the client's region its reference names, else the front
        end's slab at the offset it reserved."""
        if ref is not None:
            return self._writer_for(ref, shape, writers)
        return self._slab.array(_offset(offset, name), shape, dtype)

    def _regions(self) -> ClientRegions:
        if self._client_regions is None:
            raise InvalidInput("client shared memory is off on this server")
        return self._client_regions

    def _client_input(
        self, tensor: ClientTensor, shape: tuple[int, ...], model: OnnxModel
    ) -> tuple[Callable[[bool], np.ndarray], int]:
        """Check an input's reference now; what reads it (one copy), checks its values and
        casts it to the model's dtype (called with on_loop: on this loop, or on a thread),
        and its size. The region is held until it is read (an unregister meanwhile cannot
        close its descriptor under the read)."""
        region_ref = tensor.ref
        dtype = np.dtype(tensor.dtype)  # as the client wrote it
        region = self._regions().checked(region_ref)
        need = math.prod(shape) * dtype.itemsize
        if region_ref.byte_size != need:
            raise InvalidInput(
                f"{region_ref.where} has shared_memory_byte_size {region_ref.byte_size}; shape "
                f"{list(shape)} of {dtype.name} needs {need} bytes"
            )
        region.retain()
        loop = asyncio.get_running_loop()

        def read(on_loop: bool) -> np.ndarray:
            try:
                batch = region.read(region_ref.offset, need).view(dtype).reshape(shape)
                check_finite(batch)
                return in_model_dtype(batch, model.spec.dtype, model.spec.name)
            finally:
                if on_loop:
                    region.release()
                else:
                    with contextlib.suppress(RuntimeError):  # a loop already closed: exiting
                        loop.call_soon_threadsafe(region.release)

        return read, need

    def _writer_for(
        self, tensor: ClientTensor, shape: tuple[int, ...], writers: list[RegionWriter]
    ) -> RegionWriter:
        """A writer of one answer of shape into a client's region, checked against the
        region's bounds and the answer's size now, before compute."""
        region_ref, dtype = tensor.ref, np.dtype(tensor.dtype)
        region = self._regions().checked(region_ref)
        need = math.prod(shape) * dtype.itemsize
        if need > region_ref.byte_size:
            raise InvalidInput(
                f"{region_ref.where} needs {need} bytes; its shared_memory_byte_size is "
                f"{region_ref.byte_size}"
            )
        writer = RegionWriter(region, region_ref.offset, need, dtype)
        writers.append(writer)
        return writer

    @staticmethod
    def _close(writers: list[RegionWriter]) -> None:
        for writer in writers:
            writer.close()

    def _withdraw(self, request_id: int) -> None:
        """The front end cancelled: a queued request is dropped (and answered CANCELLED); one
        computing is answered when its batch ends, having written into its regions; one whose
        input is being read is answered now and dropped once read."""
        if self._reading.pop(request_id, None) is not None:
            self._send_cancelled(request_id)
            return
        ticket = self._submitted.get(request_id)
        if ticket is not None:
            self._batcher.withdraw(ticket)

    def _answer(
        self, request_id: int, writers: list[RegionWriter], outcome: Result | BaseException
    ) -> None:
        """Exactly one DONE or FAIL answers each request, sent only after the compute thread
        wrote its last byte into the request's regions (the front end frees them on it).
        The batcher calls it once, in the turn the request's batch ended (or it left the
        queue); the DONEs of one batch leave in one write."""
        self._submitted.pop(request_id, None)
        if writers:
            self._close(writers)
            failed_write = next((w.error for w in writers if w.error is not None), None)
            if failed_write is not None and isinstance(outcome, Result):
                outcome = failed_write
        if self._gone:
            return
        if isinstance(outcome, asyncio.CancelledError):
            self._send_cancelled(request_id)
            return
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, ServingError):
                log.error(
                    "request %d from front end %s failed", request_id, self.name, exc_info=outcome
                )
            self._fail(request_id, outcome)
            return
        result = outcome
        self.send(
            Done(
                request_id=request_id,
                queue_s=result.queue_s,
                compute_s=result.compute_s,
                batch_size=result.batch_size,
                started_at=result.started_at,
                padding=result.padding,
                batch_id=result.batch_id,
                # The tags came in with this worker's INFERs, every one a TraceTag.
                tags=cast(tuple[TraceTag, ...], result.batch_tags),
            )
        )

    def _send_cancelled(self, request_id: int) -> None:
        cancelled = ErrorText(messages.CANCELLED, "cancelled by the front end")
        self.send(Fail(request_id, cancelled))

    def _fail(self, request_id: int, error: BaseException) -> None:
        self.send(Fail(request_id, messages.error_text(error, "the worker failed this request")))

    async def _control(self, message: Call) -> None:
        try:
            result = await self._call(message.op, message.args)
        except Exception as err:
            if not isinstance(err, ServingError):
                log.exception("control call %s from front end %s failed", message.op, self.name)
            error = messages.error_text(err, "the worker failed this call")
            self.send(Reply(message.call_id, error=error))
            return
        self.send(Reply(message.call_id, result=result))


class _Incoming(asyncio.Protocol):
    """A front end's socket, read by the event loop's own read callback."""

    def __init__(self, link: FrontendLink) -> None:
        self._link = link
        self._framer = channel.Framer()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports are not asyncio.Transport's
        # subclasses, though they are stream transports with its methods.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        self._link._connected(transport)

    def data_received(self, data: bytes) -> None:
        framer = self._framer
        framer.add(data)
        while True:
            try:
                received = framer.split()
            except ValueError as err:
                self._link._lost(err)
                if self._transport is not None:
                    self._transport.close()
                return
            if not received:
                return
            self._link._received(received)

    def eof_received(self) -> bool:
        return False  # close the transport: the front end has gone

    def connection_lost(self, exc: Exception | None) -> None:
        self._link._lost(exc)


def _offset(offset: int | None, name: str) -> int:
    """Where in the slab a tensor sent without a region reference is: the INFER says."""
    if offset is None:
        raise ValueError(f"the request names neither a region nor a slab offset for its {name}")
    return offset


class LinkListener:
    """Accepts front ends on a Unix socket; each hello brings its slab's descriptor."""

    def __init__(
        self,
        path: Path,
        on_link: Callable[[FrontendLink], Awaitable[None]],
        make_link: Callable[..., FrontendLink],
    ) -> None:
        self._path = path
        self._on_link = on_link
        self._make_link = make_link
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Future[None]] = set()  # and the links they serve

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self._path))
        os.chmod(self._path, 0o600)  # only this user's processes reach the worker
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._task = asyncio.create_task(self._accept(), name="link-accept")

    async def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            task = asyncio.ensure_future(self._handshake(connection))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, connection: socket.socket) -> None:
        try:
            connection.setblocking(True)
            connection.settimeout(channel.HELLO_TIMEOUT_S)
            hello, fds = await asyncio.to_thread(channel.receive_hello, connection)
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise ValueError(f"hello carried {len(fds)} descriptors, expected 1")
            slab = Slab.attach(fds[0])
            connection.settimeout(None)
            connection.setblocking(False)
            link = self._make_link(hello.name, slab)
            await asyncio.get_running_loop().create_unix_connection(link.protocol, sock=connection)
        except (OSError, ValueError) as err:
            log.warning("a front end's handshake failed: %s", err)
            connection.close()
            return
        await self._on_link(link)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
