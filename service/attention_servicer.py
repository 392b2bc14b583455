"""attention.v1.AttentionService: decode, validate, batch, encode. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from service.admission import admit_and_run
from service.batcher import Batcher
from service.codec import decode_tensor, encode_tensor, wire_dtype
from service.engine import OnnxModel
from service.errors import InvalidInput
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.registry import SERVER_LABEL, ModelRegistry
from service.rpc import rpc
from service.settings import Settings
from service.streaming import StreamCalls, serve_stream
from service.validation import InputLimits

API = "attention"
STREAM_API = "attention_stream"
# The setting's default (a dataclass field's default is its class attribute), for a server
# that does not pass the setting in.
DEFAULT_STREAM_INFLIGHT: int = Settings.max_stream_inflight_requests


def model_info(name: str, versions: list[OnnxModel], limits: InputLimits) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=name,
        versions=[
            pb.ModelVersionInfo(
                version=str(model.spec.version),
                embed_dim=model.spec.embed_dim,
                num_heads=model.spec.num_heads,
                causal=model.spec.causal,
                dtype=wire_dtype(model.spec.dtype),
                input_dtypes=[pb.FLOAT32, pb.FLOAT16],
                weights_sha256=model.spec.weights_sha256,
                weights_source=model.spec.weights_source,
                execution_provider=model.provider,
            )
            for model in versions
        ],
        max_sequence_length=limits.max_seq_len,
        max_batch_size=limits.max_batch_size,
    )


def _stream_error(
    request: pb.AttendRequest, code: grpc.StatusCode, message: str
) -> pb.AttendStreamResponse:
    return pb.AttendStreamResponse(
        request_id=request.request_id, error=pb.StreamError(code=code.value[0], message=message)
    )


class AttentionServicer(attention_pb2_grpc.AttentionServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        batcher: Batcher,
        limits: InputLimits,
        *,
        max_stream_inflight_requests: int = DEFAULT_STREAM_INFLIGHT,
    ) -> None:
        self._registry = registry
        self._batcher = batcher
        self._limits = limits
        self._max_stream_inflight = max_stream_inflight_requests
        self._stream_calls = StreamCalls(
            api=STREAM_API,
            answer=self._stream_answer,
            failure=_stream_error,
            model_label=self.model_label,
            request_id=self.request_id,
        )

    def model_label(self, request: Any) -> str:
        if not hasattr(request, "model"):
            return SERVER_LABEL  # ListModels concerns no single model
        return self._registry.metric_label(request.model)

    def request_id(self, request: Any) -> str:
        return getattr(request, "request_id", "")

    @rpc(API)
    async def Attend(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse:
        response = pb.AttendResponse()
        await self._attend(request, context, response)
        return response

    async def AttendStream(
        self, requests: AsyncIterator[pb.AttendRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_stream(
            self._stream_calls, requests, context, max_inflight=self._max_stream_inflight
        )

    async def _stream_answer(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttendStreamResponse:
        answer = pb.AttendStreamResponse(request_id=request.request_id)
        await self._attend(request, context, answer.response)
        return answer

    async def _attend(
        self,
        request: pb.AttendRequest,
        context: grpc.aio.ServicerContext,
        response: pb.AttendResponse,
    ) -> None:
        """The one Attend path, unary and streamed. It fills response in place: a streamed
        answer is built inside its envelope, not copied into it (outputs can be large)."""
        model = self._registry.resolve(request.model, request.model_version)
        if not request.HasField("embeddings"):
            raise InvalidInput("embeddings is missing; expected a Tensor [seq, d] or [n, seq, d]")
        received = decode_tensor(request.embeddings, "embeddings")
        result = await admit_and_run(
            self._batcher,
            model,
            received,
            self._limits,
            with_weights=request.return_attention_weights,
            context=context,
        )
        output = result.output if received.ndim == 3 else result.output[0]
        response.output.CopyFrom(encode_tensor(output, received.dtype))
        response.model = model.spec.name
        response.model_version = str(model.spec.version)
        response.request_id = request.request_id
        response.timing.queue_us = round(result.queue_s * 1e6)
        response.timing.compute_us = round(result.compute_s * 1e6)
        response.timing.batch_size = result.batch_size
        if result.attention_weights is not None:
            weights = result.attention_weights
            response.attention_weights.CopyFrom(
                encode_tensor(weights if received.ndim == 3 else weights[0], np.dtype("float32"))
            )

    @rpc(API)
    async def GetModel(
        self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        name = self._registry.resolve(request.model, "").spec.name
        return model_info(name, self._registry.versions(name), self._limits)

    @rpc(API)
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[
                model_info(name, self._registry.versions(name), self._limits)
                for name in self._registry.names()
            ]
        )
