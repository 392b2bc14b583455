"""The front end's DataPlane: requests go to the worker process through shared memory.

A request's tensor is copied once, from the received message into this front end's slab;
the worker batches from there and writes the answer back into the slab, from which the
servicer encodes the response. Only small control messages (service/ipc/records.py) cross
the socket. When the worker goes away, every call in flight fails at once with UNAVAILABLE
and the client keeps reconnecting (the supervisor restarts the worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.catalog import ModelRegistry, ServedModel
from service.dataplane import IndexEntry, RegionTensor, Result, Targets, VersionStats
from service.errors import QueueFull, ShuttingDown
from service.ipc import channel, messages
from service.ipc.records import (
    Call,
    Cancel,
    ClientTensor,
    Done,
    Fail,
    Hello,
    InferRequest,
    Message,
    Models,
    Reply,
    Sync,
    Synced,
)
from service.ipc.slab import (
    HEADER_BYTES,
    RELEASE_BYTES,
    Region,
    RegionAllocator,
    Slab,
    embedding_bytes,
)
from service.ipc.status_page import StatusView, page_path
from service.memory.budget import (
    IDLE_TRIM_AFTER_S,
    TRIM_AFTER_BATCH_BYTES,
    release_free_memory,
)
from service.observability import tracing
from service.status_texts import NOT_ACCEPTING, WORKER_GONE, WORKER_RESTARTING

log = logging.getLogger(__name__)
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 1.0


@dataclass(eq=False)
class _Link:
    """One connection to one worker process: its slab, writer and calls in flight."""

    slab: Slab
    allocator: RegionAllocator
    writer: channel.Writer
    calls: dict[int, _Call] = field(default_factory=dict)
    alive: bool = True
    welcomed: bool = False  # the worker's first snapshot arrived on this link

    high_water: int = 0  # most bytes in use since the slab last gave its pages back
    recent: int = 0  # most bytes in use since the trim timer was set
    churned: int = 0  # bytes allocated since then (each request's buffers pass through malloc)
    idle_trim: asyncio.TimerHandle | None = None
    sent_requests: int = 0  # INFERs sent on this link, and their embeddings' bytes
    sent_bytes: int = 0

    def unread(self) -> tuple[int, int]:
        """INFERs (and their embeddings' bytes) sent that the worker has not read yet: on
        their way to its queue, where its status page does not count them."""
        read_requests, read_bytes = self.slab.read_counts()
        return self.sent_requests - read_requests, self.sent_bytes - read_bytes

    def send(self, request: InferRequest) -> None:
        self.sent_requests += 1
        self.sent_bytes += embedding_bytes(request.shape, request.dtype)
        self.writer.send(request)

    def alloc(self, nbytes: int) -> Region:
        region = self.allocator.alloc(nbytes)
        used = self.allocator.used
        if used > self.recent:
            self.recent = used
            self.high_water = max(self.high_water, used)
        self.churned += nbytes
        return region

    def reserve(self, sizes: list[int]) -> list[Region]:
        """A region of each size, or none (SlabFull, SlabTooSmall)."""
        regions: list[Region] = []
        try:
            for nbytes in sizes:
                regions.append(self.alloc(nbytes))
        except BaseException:
            self.free(regions)
            raise
        return regions

    def free(self, regions: list[Region]) -> None:
        for region in regions:
            self.allocator.free(region)
            if region.nbytes >= RELEASE_BYTES:
                self.slab.release_pages(region)
        if self.idle_trim is None and (
            self._spiked() or (self.allocator.used == 0 and self._churned_enough())
        ):
            self._trim_when_idle_later()

    def _churned_enough(self) -> bool:
        return self.high_water >= TRIM_AFTER_BYTES or self.churned >= TRIM_AFTER_BATCH_BYTES

    def _spiked(self) -> bool:
        """Whether the slab has held RELEASE_BYTES more than it holds now: freed regions
        under that size keep their pages, so a spike's would stay resident (charged to the
        container) for as long as calls keep coming and the slab never empties. The trim
        timer then looks whether the whole interval stayed that far below."""
        return self.high_water - self.allocator.used >= RELEASE_BYTES

    def _trim_when_idle_later(self) -> None:
        """After a burst that took TRIM_AFTER_BYTES of the slab at once, traffic that passed
        TRIM_AFTER_BATCH_BYTES through it since the last trim, or a spike (_spiked): look
        again in IDLE_TRIM_AFTER_S and trim if no request came meanwhile, or give back what a
        spike left free if some did. Later, not now: gRPC still holds the last answers'
        buffers and the refused requests' until it has written them, and malloc keeps up to
        its trim threshold of freed memory in each arena (measured: the front end kept 12-116
        MiB after a 3x overload at seq 64 when it trimmed as the last region came back)."""
        self.recent = self.allocator.used  # the interval's use starts from here
        loop = asyncio.get_running_loop()
        self.idle_trim = loop.call_later(IDLE_TRIM_AFTER_S, self._trim_if_idle, self.churned)

    def _trim_if_idle(self, churned: int) -> None:
        """Idle after a burst: the pages its small regions took go back to the kernel (shared
        memory is charged to the container until then), and so do malloc's free pages, which
        the burst's request and response buffers left in its arenas. Busy: only what a spike
        left free goes back."""
        self.idle_trim = None
        if not self.alive:
            return
        if self.allocator.used == 0 and churned == self.churned:
            self.slab.release_pages(Region(HEADER_BYTES, self.slab.capacity))
            release_free_memory()
            self.high_water = self.recent = self.churned = 0
            return
        # Busy meanwhile. A whole interval RELEASE_BYTES below the slab's peak: the spike is
        # over, and what it left free goes back now (use that dips and climbs within an
        # interval keeps its pages); the rest goes once idle.
        if self.high_water - self.recent >= RELEASE_BYTES:
            for block in self.allocator.free_blocks():
                self.slab.release_pages(block)
            self.high_water = self.recent
        if self._churned_enough() or self._spiked():
            self._trim_when_idle_later()


def _infer_request(
    request_id: int,
    model: ServedModel,
    embeddings: np.ndarray | RegionTensor,
    *,
    with_weights: bool,
    deadline: float | None,
    tag: object,
    targets: Targets,
    at: dict[str, int],
) -> InferRequest:
    """The tensors by slab offset (at) or, for those in a client's region, by reference."""
    request = InferRequest(
        request_id=request_id,
        model_key=model.key,
        with_weights=with_weights,
        shape=embeddings.shape,
        dtype=model.spec.dtype.str,
        deadline=deadline,
        input_offset=at.get("in"),
        output_offset=at.get("out"),
        weights_offset=at.get("wout"),
        tag=tracing.tag_numbers(tag),
    )
    if isinstance(embeddings, RegionTensor):
        # As the client wrote it: the worker checks and casts it once read.
        request.input_ref = ClientTensor(embeddings.ref, embeddings.dtype.str)
    if targets:
        output, weights = targets.get("output"), targets.get("attention_weights")
        if output is not None:
            request.output_ref = ClientTensor(output.ref, output.dtype.str)
        if weights is not None and with_weights:
            request.weights_ref = ClientTensor(weights.ref, weights.dtype.str)
    return request


def _refusal(answer: Done | Fail | Reply) -> Exception:
    """The error the worker's answer stands for (a Fail, or a Reply with an error); one
    that answers the wrong kind of call is the worker's fault."""
    error = answer.error if isinstance(answer, Fail | Reply) else None
    if error is None:
        return messages.WorkerError(f"the worker answered with an unexpected {answer!r}")
    return messages.rebuild_error(error.kind, error.message)


def _placeholder(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only array of shape and dtype that takes no memory: what an answer written into
    a client's region leaves in its Result."""
    return np.broadcast_to(np.zeros((), dtype), shape)


# A burst that took this much shared memory is given back once idle (budget.IDLE_TRIM_AFTER_S).
TRIM_AFTER_BYTES = 16 << 20


@dataclass(eq=False)
class _Call:
    future: asyncio.Future[Done | Fail | Reply]
    regions: list[Region] = field(default_factory=list)
    abandoned: bool = False  # the caller went away; free the regions on the final answer


class WorkerClient:
    """connect_forever() keeps a connection to the worker; infer() and the control calls
    use it. models is the served set as the worker last reported it."""

    def __init__(
        self,
        socket_path: Path,
        name: str,
        slab_bytes: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._socket_path = socket_path
        self._status = StatusView(page_path(socket_path.parent))  # the worker's queue fill
        self._name = name
        self._slab_bytes = slab_bytes
        self._on_change = on_change
        self._models: ModelRegistry[ServedModel] = ModelRegistry([], "")
        self._link: _Link | None = None
        self._ids = itertools.count(1)
        self._welcomed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self.worker_ready = False  # connected, and the worker is warm
        self.accepting = True  # False once this front end drains
        # From the drain's first moment: the supervisor restarts no worker lost after it.
        self.draining = False
        self._task: asyncio.Task[None] | None = None

    @property
    def models(self) -> ModelRegistry[ServedModel]:
        return self._models

    @property
    def ready(self) -> bool:
        return self.worker_ready and self.accepting

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect_forever(), name="worker-link")

    async def wait_welcomed(self) -> None:
        """Until the first snapshot of the served set has arrived."""
        await self._welcomed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the connection ---------------------------------------------------------------------

    async def _connect_forever(self) -> None:
        delay = RECONNECT_FIRST_S
        while True:
            try:
                reader, link = await self._connect()
            except OSError:
                await asyncio.sleep(delay)  # the worker is starting (or restarting)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            self._link = link
            try:
                await self._read(reader, link)
            finally:
                self._lost(link)
            if link.welcomed:
                delay = RECONNECT_FIRST_S  # a worker that served this link: it restarts
            else:
                # Refused before its welcome (a failed handshake): retrying at once would
                # spin, each try a new slab on both sides.
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)

    async def _connect(self) -> tuple[asyncio.StreamReader, _Link]:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, str(self._socket_path))
            slab = Slab.create(self._slab_bytes, f"attention-{self._name}")
        except BaseException:
            sock.close()
            raise
        try:
            sock.setblocking(True)
            channel.send_hello(sock, Hello(name=self._name, pid=os.getpid()), [slab.fd])
            sock.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            slab.close()
            raise
        slab.close()  # the mapping stays; the worker holds its own descriptor now
        return reader, _Link(slab, RegionAllocator(slab.capacity), channel.Writer(writer))

    async def _read(self, reader: asyncio.StreamReader, link: _Link) -> None:
        messages_in = channel.Reader(reader)
        try:
            while True:
                for message in await messages_in.read():
                    self._dispatch(link, message)
        except channel.ChannelClosed:
            log.warning("the worker closed its connection; failing calls in flight, reconnecting")
        except (ValueError, KeyError, TypeError) as err:
            log.error("malformed message from the worker (%s); reconnecting", err)

    def _lost(self, link: _Link) -> None:
        link.alive = False
        if link.idle_trim is not None:
            link.idle_trim.cancel()
        link.writer.close()
        if self._link is link:
            self._link = None
        calls, link.calls = link.calls, {}
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(ShuttingDown(WORKER_GONE))
        if self.worker_ready:
            self.worker_ready = False
            self._on_change()

    def _dispatch(self, link: _Link, message: Message) -> None:
        if isinstance(message, Done | Fail | Reply):
            # Requests and control calls draw their ids from one counter.
            call_id = message.call_id if isinstance(message, Reply) else message.request_id
            call = link.calls.pop(call_id, None)
            if call is None:
                return
            if call.abandoned:
                link.free(call.regions)
            elif not call.future.done():
                call.future.set_result(message)
        elif isinstance(message, Models):
            link.welcomed = True
            self._apply_snapshot(message)
        elif isinstance(message, Sync):
            link.writer.send(Synced(message.sync_id))
        else:
            raise ValueError(f"a front end is not sent {type(message).__name__} messages")

    def _apply_snapshot(self, message: Models) -> None:
        self._models = ModelRegistry(list(message.models), message.default_model)
        self.worker_ready = message.ready
        self._welcomed.set()
        self._on_change()

    # -- requests ---------------------------------------------------------------------------

    def _usable_link(self) -> _Link:
        if not self.accepting:
            raise ShuttingDown(NOT_ACCEPTING)
        link = self._link
        if link is None or not link.alive:
            raise ShuttingDown(self._link_gone())
        if not self.worker_ready:
            raise ShuttingDown(NOT_ACCEPTING)
        return link

    def _link_gone(self) -> str:
        return NOT_ACCEPTING if self.draining else WORKER_RESTARTING

    async def infer(
        self,
        model: ServedModel,
        embeddings: np.ndarray | RegionTensor,
        *,
        with_weights: bool,
        deadline: float | None,
        tag: object = None,
        targets: Targets | None = None,
    ) -> Result:
        link = self._usable_link()
        n, seq, d = embeddings.shape
        # Refused here, by the worker's own rule and words, before the tensor is copied or
        # the worker asked, counting what this link sent that the worker has not read yet;
        # the worker still refuses what slips through between updates.
        refusal = self._status.refusal(n * seq * d * model.spec.dtype.itemsize, *link.unread())
        if refusal is not None:
            raise QueueFull(refusal)
        targets = targets or {}
        output_target, weights_target = targets.get("output"), targets.get("attention_weights")
        weights_shape = (n, model.spec.num_heads, seq, seq)
        # Room in the slab for what travels through it: the input from the message, and
        # each answer that goes back in the message.
        sizes = {
            "in": embeddings.nbytes if isinstance(embeddings, np.ndarray) else 0,
            "out": n * seq * d * model.spec.dtype.itemsize if output_target is None else 0,
            "wout": 4 * math.prod(weights_shape) if with_weights and not weights_target else 0,
        }
        wanted = [key for key, nbytes in sizes.items() if nbytes]
        call = _Call(
            asyncio.get_running_loop().create_future(), link.reserve([sizes[key] for key in wanted])
        )
        regions = call.regions
        at = {key: region.offset for key, region in zip(wanted, regions, strict=True)}
        if isinstance(embeddings, np.ndarray):
            np.copyto(link.slab.array(at["in"], embeddings.shape, embeddings.dtype), embeddings)
        request_id = next(self._ids)
        request = _infer_request(
            request_id,
            model,
            embeddings,
            with_weights=with_weights,
            deadline=deadline,
            tag=tag,
            targets=targets,
            at=at,
        )
        link.calls[request_id] = call
        link.send(request)
        self._enter()
        try:
            answer = await call.future
        except asyncio.CancelledError:
            self._abandon(link, request_id, call)
            raise
        except BaseException:
            # Abandoned (failed at the drain's end): freed when the worker's answer comes,
            # since it may still be writing; on a lost link the slab went with it.
            if not call.abandoned and link.alive:
                link.free(regions)
            raise
        finally:
            self._leave()
        if not isinstance(answer, Done):
            link.free(regions)
            raise _refusal(answer)
        # The worker answered in the model's dtype; an answer in a client's region is not
        # here at all: its array stands for the shape and dtype written (no memory).
        output = (
            link.slab.array(at["out"], (n, seq, d), model.spec.dtype)
            if output_target is None
            else _placeholder((n, seq, d), output_target.dtype)
        )
        weights = None
        if with_weights:
            weights = (
                link.slab.array(at["wout"], weights_shape, np.dtype("float32"))
                if weights_target is None
                else _placeholder(weights_shape, weights_target.dtype)
            )
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                link.free(regions)

        return Result(
            output,
            weights,
            answer.queue_s,
            answer.compute_s,
            answer.batch_size,
            started_at=answer.started_at,
            padding=answer.padding,
            batch_id=answer.batch_id,
            batch_tags=tracing.tags_from_numbers(answer.tags),
            release=release,
        )

    def _abandon(self, link: _Link, request_id: int, call: _Call) -> None:
        """The caller went away: the worker drops the request, and its regions are freed once
        the worker's final answer says it wrote nothing more into them."""
        if not link.alive:
            return  # the slab went with the connection
        if request_id in link.calls:
            call.abandoned = True
            link.writer.send(Cancel(request_id))
        else:
            link.free(call.regions)  # answered just as it was cancelled

    def _enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def fail_in_flight(self, error: Exception) -> None:
        """Answer every call still waiting with error now; the worker's answers, when they
        come, only free the shared memory."""
        link = self._link
        if link is None:
            return
        for call in link.calls.values():
            if not call.future.done():
                call.abandoned = True
                call.future.set_exception(error)

    async def wait_idle(self) -> None:
        """Until no call of this front end is waiting for the worker."""
        await self._idle.wait()

    # -- control calls ----------------------------------------------------------------------

    async def _call(self, op: str, args: dict[str, Any]) -> Any:
        link = self._link
        if link is None or not link.alive:
            raise ShuttingDown(self._link_gone())
        call = _Call(asyncio.get_running_loop().create_future())
        call_id = next(self._ids)
        link.calls[call_id] = call
        link.writer.send(Call(call_id, op, args))
        try:
            answer = await call.future
        except asyncio.CancelledError:
            link.calls.pop(call_id, None)
            raise
        if not isinstance(answer, Reply) or answer.error is not None:
            raise _refusal(answer)
        return answer.result

    async def flush(self) -> None:
        """This front end is draining: ask the worker to stop waiting for batches to fill."""
        with contextlib.suppress(ShuttingDown):
            await self._call("flush", {})

    async def statistics(self, keys: list[str]) -> dict[str, VersionStats]:
        found = await self._call("statistics", {"keys": keys})
        return {key: messages.stats_from_json(data) for key, data in found.items()}

    async def index(self, *, ready_only: bool) -> list[IndexEntry]:
        rows = await self._call("index", {"ready_only": ready_only})
        return [messages.index_from_json(row) for row in rows]

    async def load(self, name: str, peer: str = "") -> None:
        await self._call("load", {"name": name, "peer": peer})

    async def unload(self, name: str, peer: str = "") -> None:
        await self._call("unload", {"name": name, "peer": peer})

    # Client shared memory: the regions live in the worker, one registry for every front end.

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        args = {"name": name, "key": key, "offset": offset, "byte_size": byte_size}
        await self._call("shm_register", args)

    async def shm_unregister(self, name: str) -> None:
        await self._call("shm_unregister", {"name": name})

    async def shm_status(self, name: str) -> list[tuple[str, str, int, int]]:
        rows = await self._call("shm_status", {"name": name})
        return [(str(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows]
