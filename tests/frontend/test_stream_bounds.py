"""Streams and calls under abuse: unparsable messages, clients that do not read, clients that
leave. The stream machinery alone runs on a real grpc.aio server in this process; the
unparsable-message checks go to the real server over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as triton_v2

from service.frontend.handlers import add_servicer
from service.frontend.streaming import StreamCalls, serve_stream
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.transport.wire import WireMessage
from tests.harness.server_process import ServerProcess

TIMEOUT_S = 60
GARBAGE = b"\xff\xff\xff\xff\xff"  # a field key whose varint never ends: no message parses it
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _attend(request_id: str, seq: int = 4, d: int = 512) -> bytes:
    x = np.ones((seq, d), np.float32)
    tensor = pb.Tensor(shape=list(x.shape), dtype=pb.FLOAT32, data=x.tobytes())
    return pb.AttendRequest(embeddings=tensor, request_id=request_id).SerializeToString()


def _infer(request_id: str) -> bytes:
    request = triton_v2.ModelInferRequest(model_name="mha", id=request_id)
    request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 4, 512])
    request.raw_input_contents.append(np.ones((1, 4, 512), np.float32).tobytes())
    return request.SerializeToString()


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("/attention.v1.AttentionService/Attend", "AttendRequest"),
        ("/inference.GRPCInferenceService/ModelInfer", "ModelInferRequest"),
    ],
)
def test_an_unparsable_call_is_invalid_argument_and_counted(
    server: ServerProcess, method: str, expected: str
) -> None:
    before = server.metric("attention_requests_total", code="INVALID_ARGUMENT")
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(method)(GARBAGE, timeout=TIMEOUT_S)
    assert caught.value.code() == INVALID
    assert f"not a valid {expected} message" in caught.value.details()
    # Counted as the call ends, in the front end's process: polled, not read at once.
    counted = server.wait_metric("attention_requests_total", before + 1, code="INVALID_ARGUMENT")
    assert counted == before + 1


def test_an_unparsable_stream_message_gets_its_error_and_the_stream_goes_on(
    server: ServerProcess,
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        attend = channel.stream_stream("/attention.v1.AttentionService/AttendStream")
        answers = [
            pb.AttendStreamResponse.FromString(raw)
            for raw in attend(iter([_attend("a"), GARBAGE, _attend("b")]), timeout=TIMEOUT_S)
        ]
        infer = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        v2_answers = [
            triton_v2.ModelStreamInferResponse.FromString(raw)
            for raw in infer(iter([_infer("a"), GARBAGE, _infer("b")]), timeout=TIMEOUT_S)
        ]
    by_id = {answer.request_id: answer for answer in answers}
    assert sorted(by_id) == ["", "a", "b"]
    assert by_id[""].error.code == INVALID.value[0]
    assert "not a valid AttendRequest message" in by_id[""].error.message
    assert list(by_id["a"].response.output.shape) == [4, 512]
    assert list(by_id["b"].response.output.shape) == [4, 512]
    errors = [answer.error_message for answer in v2_answers if answer.error_message]
    assert len(errors) == 1
    assert "not a valid ModelInferRequest message" in errors[0]
    assert sorted(a.infer_response.id for a in v2_answers if not a.error_message) == ["a", "b"]


ANSWER_BYTES = 256 << 10


class _Echo(attention_pb2_grpc.AttentionServiceServicer):
    """Answers every request with ANSWER_BYTES of zeros; counts what it computed."""

    def __init__(self, max_pending_bytes: int) -> None:
        self.computed = 0
        self.computed_four = asyncio.Event()
        self.max_pending_bytes = max_pending_bytes

    async def AttendStream(self, requests, context) -> None:
        calls = StreamCalls(
            api="attention_stream",
            answer=self._answer,
            failure=lambda request, code, message: pb.AttendStreamResponse(
                error=pb.StreamError(code=code.value[0], message=message)
            ),
            model_label=lambda request: "_unknown",
            request_id=lambda request: request.request_id,
            answer_bytes=lambda request: ANSWER_BYTES,
        )
        await serve_stream(
            calls, requests, context, max_inflight=256, max_pending_bytes=self.max_pending_bytes
        )

    async def _answer(self, request: pb.AttendRequest, context) -> WireMessage:
        self.computed += 1
        if self.computed >= 4:
            self.computed_four.set()
        envelope = WireMessage.of(pb.AttendStreamResponse(request_id=request.request_id))
        return envelope.add_bytes(4, bytes(ANSWER_BYTES))  # an unknown field: bulk only


# The client's own flow-control window stays at 64 KiB: what it does not read stays on the
# server, as with a client that is slow rather than one with a big buffer.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]


@contextlib.asynccontextmanager
async def _stream_of_40(servicer: _Echo) -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """A real grpc.aio server with the servicer, and a 40-request stream to it."""
    server = grpc.aio.server()
    add_servicer(server, attention_pb2_grpc.add_AttentionServiceServicer_to_server, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=SMALL_WINDOW) as channel:
            yield attention_pb2_grpc.AttentionServiceStub(channel).AttendStream(
                iter([pb.AttendRequest(request_id=str(i)) for i in range(40)]), timeout=TIMEOUT_S
            )
    finally:
        await server.stop(None)


def test_a_client_that_does_not_read_holds_back_its_stream_by_bytes() -> None:
    """40 requests of 256 KiB answers under a 1 MiB bound: the server computes what fits the
    bound (plus one read before the bound was seen) and then reads no more until the client
    takes answers; in the end every request is answered."""

    async def session() -> tuple[int, int, int]:
        servicer = _Echo(max_pending_bytes=1 << 20)
        async with _stream_of_40(servicer) as call:
            await asyncio.wait_for(servicer.computed_four.wait(), TIMEOUT_S)
            # Time to over-read, had the bound not held (a negative check needs a window).
            await asyncio.sleep(0.3)
            held_back = servicer.computed
            answers = [answer async for answer in call]
            return held_back, len(answers), servicer.computed

    held_back, answered, computed = asyncio.run(session())
    assert 4 <= held_back <= 6  # 1 MiB / 256 KiB, and at most what one write and read add
    assert answered == computed == 40


def test_a_client_that_cancels_mid_stream_is_not_an_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def session() -> grpc.StatusCode:
        async with _stream_of_40(_Echo(max_pending_bytes=1 << 30)) as call:
            await call.read()  # answers are being written when the client leaves
            call.cancel()
            return await call.code()

    with caplog.at_level(logging.INFO):
        code = asyncio.run(session())
    assert code == grpc.StatusCode.CANCELLED
    # Ours only: grpc's own core logs the handler's cancellation as it sees fit.
    failures = [
        r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("service")
    ]
    assert failures == []
