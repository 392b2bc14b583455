"""One request in, one outcome out, over unary or streaming RPCs; bytes on both sides, so
the load generator spends no time in protobuf on the hot path."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import grpc
import numpy as np

from bench.payloads import (
    METHODS,
    Payload,
    StreamReply,
    Timing,
    attend_stream_reply,
    attend_timing,
    family,
    shm_body,
    v2_stream_reply,
    with_id,
)
from service.generated.inference import grpc_service_pb2 as v2

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # Without it, channels with equal options share one TCP connection (gRPC's global
    # subchannel pool), and --channels would add no connection.
    ("grpc.use_local_subchannel_pool", 1),
]
# What writing to a stream the server has ended raises.
STREAM_GONE = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


@dataclass(frozen=True)
class Outcome:
    code: str  # "OK" or the gRPC status code name
    timing: Timing | None
    detail: str = ""  # the error message, for the report's examples


class Caller(Protocol):
    async def call(self, payload: Payload) -> Outcome: ...

    async def close(self) -> None: ...


class UnaryCaller:
    """Attend or ModelInfer with pre-serialized bytes (no serializer: bytes go as they are)."""

    def __init__(self, channel: grpc.aio.Channel, api: str, timeout_s: float) -> None:
        self._rpc = channel.unary_unary(METHODS[api])
        self._timeout_s = timeout_s
        self._timing = family(api) == "attention"

    async def call(self, payload: Payload) -> Outcome:
        try:
            reply = await self._rpc(payload.body, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, None, err.details() or "")
        return Outcome("OK", attend_timing(reply) if self._timing else None)

    async def close(self) -> None:
        return None


class StreamCaller:
    """Many requests in flight on one bidirectional stream, matched back by request id."""

    def __init__(self, channel: grpc.aio.Channel, api: str, timeout_s: float) -> None:
        self._api = api
        self._call = channel.stream_stream(METHODS[api])(timeout=timeout_s)
        self._parse: Callable[[bytes], StreamReply] = (
            attend_stream_reply if family(api) == "attention" else v2_stream_reply
        )
        self._pending: dict[str, asyncio.Future[Outcome]] = {}
        self._ids = itertools.count()
        self._write_lock = asyncio.Lock()  # one write at a time on a grpc.aio stream
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self._call:
                reply = self._parse(message)
                future = self._pending.pop(reply.request_id, None)
                if future is not None and not future.done():
                    future.set_result(Outcome(reply.code, reply.timing))
        except grpc.aio.AioRpcError as err:
            self._fail_all(err.code().name, err.details() or "")
        except asyncio.CancelledError:
            self._fail_all("CANCELLED")
            raise
        self._fail_all("STREAM_CLOSED")

    def _fail_all(self, code: str, detail: str = "") -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_result(Outcome(code, None, detail))

    async def call(self, payload: Payload) -> Outcome:
        request_id = str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with self._write_lock:
                await self._call.write(with_id(payload.body, self._api, request_id.encode()))
        except STREAM_GONE:
            self._pending.pop(request_id, None)
            return Outcome("STREAM_CLOSED", None)
        return await future

    async def close(self) -> None:
        with contextlib.suppress(*STREAM_GONE):
            await self._call.done_writing()
        try:
            await asyncio.wait_for(self._reader, timeout=10)
        except (TimeoutError, asyncio.CancelledError):
            self._call.cancel()


class RestCaller:
    """V2 inference over HTTP/REST on one keep-alive connection pool, as a REST client
    calls it (one connection per call in flight)."""

    def __init__(
        self, session: aiohttp.ClientSession, target: str, model: str, timeout_s: float
    ) -> None:
        self._session = session
        self._url = f"http://{target}/v2/models/{model}/infer"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def call(self, payload: Payload) -> Outcome:
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(payload.header_bytes),
        }
        try:
            async with self._session.post(
                self._url, data=payload.body, headers=headers, timeout=self._timeout
            ) as reply:
                await reply.read()
                if reply.status == HTTP_OK:
                    return Outcome("OK", None)
                return Outcome(f"HTTP_{reply.status}", None, (await reply.text())[:200])
        except TimeoutError:
            return Outcome("DEADLINE_EXCEEDED", None)
        except aiohttp.ClientError as err:
            return Outcome("UNAVAILABLE", None, str(err))

    async def close(self) -> None:
        return None


HTTP_OK = 200
SHM_ROOT = "/dev/shm"
REGISTER = "/inference.GRPCInferenceService/SystemSharedMemoryRegister"
UNREGISTER = "/inference.GRPCInferenceService/SystemSharedMemoryUnregister"


class SharedMemoryCaller:
    """V2 ModelInfer with the tensors in client shared memory, as a same-host client uses
    Triton's system shared-memory extension: one POSIX object and region per caller (calls
    in flight never share one), the input at its start and the output after it. Each call
    copies its input into the region (the client's own cost) and leaves the answer there."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        name: str,
        bodies: dict[int, bytes],
        region_bytes: int,
        timeout_s: float,
    ) -> None:
        self._channel = channel
        self._name = name
        self._bodies = bodies  # by sequence length
        self._rpc = channel.unary_unary(METHODS["v2_shm"])
        self._timeout_s = timeout_s
        self._path = f"{SHM_ROOT}/{name}"
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, region_bytes)
            self._map = mmap.mmap(fd, region_bytes)
        finally:
            os.close(fd)
        self._region_bytes = region_bytes

    @classmethod
    async def open(
        cls,
        channel: grpc.aio.Channel,
        index: int,
        shapes: dict[int, list[int]],
        model: str,
        timeout_s: float,
    ) -> SharedMemoryCaller:
        """Create the caller's object and register it with the server as one region."""
        name = f"bench-{os.getpid()}-{index}"
        largest = max(4 * int(np.prod(shape)) for shape in shapes.values())
        bodies = {n: shm_body(shape, model, name, largest) for n, shape in shapes.items()}
        caller = cls(channel, name, bodies, 2 * largest, timeout_s)
        register = channel.unary_unary(
            REGISTER,
            request_serializer=v2.SystemSharedMemoryRegisterRequest.SerializeToString,
            response_deserializer=v2.SystemSharedMemoryRegisterResponse.FromString,
        )
        try:
            await register(
                v2.SystemSharedMemoryRegisterRequest(
                    name=name,
                    key=f"/{name}",
                    offset=0,
                    byte_size=2 * largest,
                ),
                timeout=timeout_s,
            )
        except BaseException:
            caller._remove()
            raise
        return caller

    async def call(self, payload: Payload) -> Outcome:
        self._map[: len(payload.body)] = payload.body
        try:
            await self._rpc(self._bodies[payload.length], timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, None, err.details() or "")
        return Outcome("OK", None)  # the answer is in the region, after the input

    async def close(self) -> None:
        unregister = self._channel.unary_unary(
            UNREGISTER,
            request_serializer=v2.SystemSharedMemoryUnregisterRequest.SerializeToString,
            response_deserializer=v2.SystemSharedMemoryUnregisterResponse.FromString,
        )
        with contextlib.suppress(grpc.aio.AioRpcError):
            await unregister(
                v2.SystemSharedMemoryUnregisterRequest(name=self._name), timeout=self._timeout_s
            )
        self._remove()

    def _remove(self) -> None:
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)


def open_channels(target: str, count: int) -> list[grpc.aio.Channel]:
    return [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(count)]


def make_callers(
    channels: list[grpc.aio.Channel], api: str, timeout_s: float, streams_per_channel: int
) -> list[Caller]:
    """One unary caller per channel, or streams_per_channel streams on each channel."""
    if api.endswith("_stream"):
        return [
            StreamCaller(channel, api, timeout_s)
            for channel in channels
            for _ in range(streams_per_channel)
        ]
    return [UnaryCaller(channel, api, timeout_s) for channel in channels]
