"""The one error-mapping wrapper: unexpected errors become INTERNAL with a request id only."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from service.errors import QueueFull
from service.frontend.attention_servicer import AttentionServicer
from service.frontend.handlers import add_servicer
from service.frontend.rpc import rpc
from service.frontend.validation import InputLimits
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.transport.codec import encode_tensor
from service.transport.wire import WireMessage
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from service.worker.engine.registry import ModelRegistry
from tests.harness.planes import LocalPlane

FORGED = "bug\n2026-01-01 INFO forged: all is well" + "x" * 20_000


class ExplodingServicer(AttentionServicer):
    """Attend fails in ways the real one might: a bug, or a domain error."""

    def __init__(self) -> None:
        limits = BatchLimits(max_batch_size=1, max_queue_delay_s=0, max_queue_size=1)
        super().__init__(LocalPlane(ModelRegistry([], "mha"), Batcher(limits)), InputLimits(8, 1))
        self.calls = 0

    @rpc("attention")
    async def Attend(self, request, context):
        self.calls += 1
        if request.request_id.startswith("bug"):
            raise KeyError("secret internal detail")
        if request.request_id == "busy":
            raise QueueFull("queue full: 1 requests waiting (max_queue_size=1)")
        if request.request_id == "slow":
            return SlowToSerialize.of(pb.AttendResponse(request_id="slow")).add_bytes(99, b"")
        return pb.AttendResponse(request_id=request.request_id)


class SlowToSerialize(WireMessage):
    """A response whose serialization takes 0.3 s."""

    def serialize(self) -> bytes:
        time.sleep(0.3)
        return super().serialize()


def test_request_duration_includes_serializing_the_response() -> None:
    """Before: the histogram stopped at the handler's return, before gRPC serialized."""

    async def scenario() -> pb.AttendResponse:
        server = grpc.aio.server()
        add_servicer(
            server, attention_pb2_grpc.add_AttentionServiceServicer_to_server, ExplodingServicer()
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = attention_pb2_grpc.AttentionServiceStub(channel)
                return await stub.Attend(pb.AttendRequest(request_id="slow"))
        finally:
            await server.stop(0)

    def total_s() -> float:
        labels = {"model": "_unknown", "api": "attention"}
        return REGISTRY.get_sample_value("attention_request_duration_seconds_sum", labels) or 0.0

    before = total_s()
    assert asyncio.run(scenario()).request_id == "slow"
    assert total_s() - before >= 0.3


def test_unexpected_error_is_internal_logged_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> list[tuple[grpc.StatusCode, str]]:
        server = grpc.aio.server()
        servicer = ExplodingServicer()
        add_servicer(server, attention_pb2_grpc.add_AttentionServiceServicer_to_server, servicer)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        request = pb.AttendRequest(embeddings=encode_tensor(np.ones((1, 2), np.float32)))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            for request_id in ("bug", "busy", "fine", FORGED):
                request.request_id = request_id
                try:
                    reply = await stub.Attend(request)
                    seen.append((grpc.StatusCode.OK, reply.request_id))
                except grpc.aio.AioRpcError as err:
                    seen.append((err.code(), err.details()))
        await server.stop(0)
        return seen

    with caplog.at_level(logging.ERROR, logger="service.frontend.rpc"):
        seen = asyncio.run(scenario())
    internal, busy, fine, forged = seen
    assert internal == (
        grpc.StatusCode.INTERNAL,
        "internal error; request_id='bug' is in the server log",
    )
    # A forged id: still INTERNAL (not RESOURCE_EXHAUSTED from oversized metadata), echoed
    # cut short and escaped, and no line of the log starts with the forged text.
    assert forged[0] == grpc.StatusCode.INTERNAL
    assert len(forged[1]) < 300
    assert "'bug\\n2026-01-01 INFO forged" in forged[1]
    assert not any(line.startswith("2026-01-01") for line in caplog.text.splitlines())
    assert all(len(record.getMessage()) < 300 for record in caplog.records)
    assert busy[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_size=1" in busy[1]
    assert fine == (grpc.StatusCode.OK, "fine")
    assert "request_id='bug'" in caplog.text
    assert "secret internal detail" in caplog.text  # in the log, never in the reply


class RefusingServicer(ExplodingServicer):
    """Attend as the real one is registered (writing its own answer), always refused."""

    @rpc("attention", holds_answer=True)
    async def Attend(self, request, context):
        raise QueueFull("queue full: 1 requests waiting (max_queue_size=1)")


def test_a_refused_call_leaves_no_reference_cycle_holding_its_request() -> None:
    """Before: the refusal raised context.abort's AbortError chained to the QueueFull, whose
    frames held the request; the cycle lived until a full collection (after a 3x overload
    the front end held 110-170 MiB of refused requests)."""

    async def scenario(request: pb.AttendRequest) -> list[grpc.StatusCode]:
        server = grpc.aio.server()
        add_servicer(
            server, attention_pb2_grpc.add_AttentionServiceServicer_to_server, RefusingServicer()
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = attention_pb2_grpc.AttentionServiceStub(channel)
                for _ in range(10):
                    try:
                        await stub.Attend(request)
                    except grpc.aio.AioRpcError as err:
                        codes.append(err.code())
        finally:
            await server.stop(0)
        return codes

    request = pb.AttendRequest(embeddings=encode_tensor(np.ones((16, 512), np.float32)))
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept for us to look at
    try:
        codes = asyncio.run(scenario(request))
        gc.collect()
        held = [
            type(found).__name__
            for found in gc.garbage
            if (isinstance(found, pb.AttendRequest) and found is not request)
            or isinstance(found, QueueFull | grpc.aio.AbortError)
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 10
    assert held == []
