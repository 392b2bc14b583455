"""The gRPC floor: a bare grpc.aio server that answers V2 ModelInfer with its input.

No validation, no admission, no worker, no batching, no metrics: a protobuf parse, a response
built from the request's own bytes, and one write on a unary-stream handler, the call shape
our front end uses (only a write tells when an answer went out). Set against the echo
floor, it shows what the server's own front end and worker cost above the gRPC library.

    python -m bench.grpc_floor --port 0    # logs "listening grpc_port=N metrics_port=0"
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

import grpc

from service.generated.inference import grpc_service_pb2 as v2

SERVICE = "inference.GRPCInferenceService"


async def model_infer(request: v2.ModelInferRequest, context: Any) -> None:
    tensor = request.inputs[0]
    response = v2.ModelInferResponse(
        model_name=request.model_name,
        model_version="1",
        id=request.id,
        raw_output_contents=request.raw_input_contents,
    )
    response.outputs.add(name="output", datatype=tensor.datatype, shape=tensor.shape)
    await context.write(response)


async def server_ready(request: v2.ServerReadyRequest, context: Any) -> v2.ServerReadyResponse:
    return v2.ServerReadyResponse(ready=True)


async def model_ready(request: v2.ModelReadyRequest, context: Any) -> v2.ModelReadyResponse:
    return v2.ModelReadyResponse(ready=True)


def handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ModelInfer": grpc.unary_stream_rpc_method_handler(
                model_infer,
                request_deserializer=v2.ModelInferRequest.FromString,
                response_serializer=v2.ModelInferResponse.SerializeToString,
            ),
            "ServerReady": grpc.unary_unary_rpc_method_handler(
                server_ready,
                request_deserializer=v2.ServerReadyRequest.FromString,
                response_serializer=v2.ServerReadyResponse.SerializeToString,
            ),
            "ModelReady": grpc.unary_unary_rpc_method_handler(
                model_ready,
                request_deserializer=v2.ModelReadyRequest.FromString,
                response_serializer=v2.ModelReadyResponse.SerializeToString,
            ),
        },
    )


async def serve(host: str, port: int) -> None:
    limit = 64 << 20
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    server.add_generic_rpc_handlers((handlers(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"listening grpc_port={bound} metrics_port=0", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
