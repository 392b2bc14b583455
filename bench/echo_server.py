"""Zero-compute echo server: python -m bench.echo_server --help.

Serves Attend, AttendStream, ModelInfer and ModelStreamInfer with the real server's
protobufs and gRPC options (service.transport.grpc_options, message limits computed as the real
server computes them) and answers every request with its own input bytes, so its
requests/s is the floor that Python gRPC alone puts under any server on this core. The
streaming calls go through the real server's stream machinery (service.frontend.streaming: a reader
task, a task per request, the in-flight bound, one writer), so the echo differs from the real
server only by the model compute.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from collections.abc import AsyncIterator
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.frontend.handlers import add_servicer
from service.frontend.streaming import StreamCalls, serve_stream
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from service.memory.malloc import keep_freed_memory
from service.settings import EVENT_LOOPS, Settings
from service.transport.grpc_options import server_options
from service.transport.wire import WireMessage, settled

TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
RESPONSE_OUTPUT = pb.AttendResponse.DESCRIPTOR.fields_by_name["output"].number
RESPONSE_WEIGHTS = pb.AttendResponse.DESCRIPTOR.fields_by_name["attention_weights"].number
STREAM_RESPONSE = pb.AttendStreamResponse.DESCRIPTOR.fields_by_name["response"].number
RAW_OUTPUT_CONTENTS = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
STREAM_INFER_RESPONSE = v2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name[
    "infer_response"
].number

log = logging.getLogger("bench.echo_server")
MODEL_NAME = "mha"
MODEL_VERSION = "1"


@lru_cache(maxsize=64)
def zeros(nbytes: int) -> bytes:
    """Zero bytes for weights responses; cached, since only the wire cost matters here."""
    return bytes(nbytes)


def weights_shape(shape: list[int], heads: int) -> list[int]:
    """[seq, d] -> [h, seq, seq]; [n, seq, d] -> [n, h, seq, seq]."""
    *lead, seq, _ = shape
    return [*lead, heads, seq, seq]


def echo_limits(
    embed_dim: int, num_heads: int, max_batch_size: int, max_seq_len: int
) -> tuple[int, int]:
    """(receive, send) bytes exactly as the real server derives them from its settings."""
    from service.frontend.limits import message_limits

    model = SimpleNamespace(spec=SimpleNamespace(embed_dim=embed_dim, num_heads=num_heads))
    settings = SimpleNamespace(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return message_limits([cast(Any, model)], cast(Any, settings))


def _model_label(request: Any) -> str:
    return MODEL_NAME


class EchoAttention(attention_pb2_grpc.AttentionServiceServicer):
    """Answers as the real servicer does (service.transport.wire framing), minus the model."""

    def __init__(self, heads: int, max_stream_inflight: int) -> None:
        self._heads = heads
        self._max_stream_inflight = max_stream_inflight
        # As service/frontend/attention_servicer.py plugs AttendStream into the stream machinery.
        self._stream_calls = StreamCalls(
            api="attention_stream",
            answer=self._stream_answer,
            failure=_attend_stream_error,
            model_label=_model_label,
            request_id=lambda request: request.request_id,
        )

    def answer(self, request: pb.AttendRequest) -> WireMessage:
        shape = list(request.embeddings.shape)
        header = pb.AttendResponse(
            model=request.model or MODEL_NAME,
            model_version=request.model_version or MODEL_VERSION,
            request_id=request.request_id,
            timing=pb.ServerTiming(batch_size=shape[0] if len(shape) == 3 else 1),
        )
        output = WireMessage.of(pb.Tensor(shape=shape, dtype=pb.FLOAT32)).add_bytes(
            TENSOR_DATA, request.embeddings.data
        )
        response = WireMessage.of(header).add_message(RESPONSE_OUTPUT, output)
        if request.return_attention_weights and len(shape) >= 2:
            wshape = weights_shape(shape, self._heads)
            weights = WireMessage.of(pb.Tensor(shape=wshape, dtype=pb.FLOAT32)).add_bytes(
                TENSOR_DATA, zeros(4 * math.prod(wshape))
            )
            response.add_message(RESPONSE_WEIGHTS, weights)
        return response

    async def Attend(self, request: pb.AttendRequest, context: Any) -> WireMessage:
        return await settled(self.answer(request))

    async def AttendStream(
        self, requests: AsyncIterator[pb.AttendRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_stream(
            self._stream_calls, requests, context, max_inflight=self._max_stream_inflight
        )

    async def _stream_answer(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        envelope = WireMessage.of(pb.AttendStreamResponse(request_id=request.request_id))
        return await settled(envelope.add_message(STREAM_RESPONSE, self.answer(request)))


def _attend_stream_error(
    request: pb.AttendRequest, code: grpc.StatusCode, message: str
) -> pb.AttendStreamResponse:
    return pb.AttendStreamResponse(
        request_id=request.request_id, error=pb.StreamError(code=code.value[0], message=message)
    )


def _v2_stream_error(
    request: v2.ModelInferRequest, code: grpc.StatusCode, message: str
) -> v2.ModelStreamInferResponse:
    return v2.ModelStreamInferResponse(
        error_message=message,
        infer_response=v2.ModelInferResponse(
            id=request.id, model_name=request.model_name, model_version=request.model_version
        ),
    )


class EchoInference(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, heads: int, max_stream_inflight: int) -> None:
        self._heads = heads
        self._max_stream_inflight = max_stream_inflight
        # As service/frontend/v2_servicer.py plugs ModelStreamInfer into the stream machinery.
        self._stream_calls = StreamCalls(
            api="v2_stream",
            answer=self._stream_answer,
            failure=_v2_stream_error,
            model_label=_model_label,
            request_id=lambda request: request.id,
        )

    def answer(self, request: v2.ModelInferRequest) -> WireMessage:
        header = v2.ModelInferResponse(
            model_name=request.model_name or MODEL_NAME,
            model_version=request.model_version or MODEL_VERSION,
            id=request.id,
        )
        if not request.inputs or not request.raw_input_contents:
            return WireMessage.of(header)
        shape = list(request.inputs[0].shape)
        header.outputs.add(name="output", datatype="FP32", shape=shape)
        raw = [request.raw_input_contents[0]]
        if any(o.name == "attention_weights" for o in request.outputs) and len(shape) >= 2:
            wshape = weights_shape(shape, self._heads)
            header.outputs.add(name="attention_weights", datatype="FP32", shape=wshape)
            raw.append(zeros(4 * math.prod(wshape)))
        response = WireMessage.of(header)
        for data in raw:
            response.add_bytes(RAW_OUTPUT_CONTENTS, data)
        return response

    async def ModelInfer(self, request: v2.ModelInferRequest, context: Any) -> WireMessage:
        return await settled(self.answer(request))

    async def ModelStreamInfer(
        self, requests: AsyncIterator[v2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_stream(
            self._stream_calls, requests, context, max_inflight=self._max_stream_inflight
        )

    async def _stream_answer(
        self, request: v2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        return await settled(WireMessage().add_message(STREAM_INFER_RESPONSE, self.answer(request)))

    async def ServerLive(self, request: Any, context: Any) -> v2.ServerLiveResponse:
        return v2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> v2.ServerReadyResponse:
        return v2.ServerReadyResponse(ready=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=0, help="0 = pick a free port")
    parser.add_argument("--embed-dim", type=int, default=512, help="d (message limits)")
    parser.add_argument("--num-heads", type=int, default=8, help="h (weights shape, limits)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="as the real server's")
    parser.add_argument("--max-seq-len", type=int, default=512, help="as the real server's")
    parser.add_argument(
        "--event-loop", choices=EVENT_LOOPS, default="auto", help="as the real server's flag"
    )
    parser.add_argument(
        "--malloc-reuse", choices=("on", "off"), default="on", help="as the real server's flag"
    )
    parser.add_argument(
        "--max-stream-inflight-requests",
        type=int,
        default=Settings.max_stream_inflight_requests,
        help="as the real server's flag: unanswered requests one stream may have",
    )
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    receive, send = echo_limits(
        args.embed_dim, args.num_heads, args.max_batch_size, args.max_seq_len
    )
    server = grpc.aio.server(options=server_options(receive_bytes=receive, send_bytes=send))
    inflight = args.max_stream_inflight_requests
    # Registered as the real server registers its servicers (WireMessage-aware serializers).
    add_servicer(
        server,
        attention_pb2_grpc.add_AttentionServiceServicer_to_server,
        EchoAttention(args.num_heads, inflight),
    )
    add_servicer(
        server,
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
        EchoInference(args.num_heads, inflight),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    # Same line as the real server's, so one launcher finds the port of either.
    log.info("listening grpc_port=%d metrics_port=0 host=%s (echo, no compute)", port, args.host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    args = parse_args(argv)
    if args.malloc_reuse == "on":
        keep_freed_memory()
    # The real server's own choice of event loop, so both sit on the same stack.
    from service.app.loops import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as runner:
        return runner.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
