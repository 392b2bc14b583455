"""attention.v1.AttentionService: decode, validate, batch, encode. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from service.catalog import SERVER_LABEL, ModelRegistry, ServedModel
from service.dataplane import DataPlane, RegionRef, RegionTarget, RegionTensor, Result
from service.errors import InvalidInput, ServingError
from service.frontend import shm_tensors
from service.frontend.admission import admit_and_run
from service.frontend.delivery import AnswerBudget
from service.frontend.restricted import Restrictions, error_details
from service.frontend.rpc import rpc
from service.frontend.streaming import (
    DEFAULT_PENDING_BYTES,
    StreamCalls,
    StreamCloser,
    serve_stream,
)
from service.frontend.validation import InputLimits, answer_estimate
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.observability.metrics import Api
from service.settings import Settings
from service.transport.codec import decode_tensor, encode_tensor_wire, tensor_layout, wire_dtype
from service.transport.wire import WireMessage, joined, settled

RESPONSE_OUTPUT = pb.AttendResponse.DESCRIPTOR.fields_by_name["output"].number
RESPONSE_WEIGHTS = pb.AttendResponse.DESCRIPTOR.fields_by_name["attention_weights"].number
STREAM_RESPONSE = pb.AttendStreamResponse.DESCRIPTOR.fields_by_name["response"].number
REGION_FIELDS = ("embeddings_region", "output_region", "attention_weights_region")
# The setting's default (a dataclass field's default is its class attribute), for a server
# that does not pass the setting in.
DEFAULT_STREAM_INFLIGHT: int = Settings.max_stream_inflight_requests


def model_info(name: str, versions: list[ServedModel], limits: InputLimits) -> pb.ModelInfo:
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
                batch_caps=[
                    pb.BatchCap(max_sequence_length=length, max_batch_size=size)
                    for length, size in model.batch_caps.caps
                ],
            )
            for model in versions
        ],
        max_sequence_length=limits.max_seq_len,
        max_batch_size=limits.max_batch_size,
    )


def stream_error(
    request: pb.AttendRequest, code: grpc.StatusCode, message: str
) -> pb.AttendStreamResponse:
    """One stream message's error: its request_id, and the code and message the unary call
    would have ended with."""
    # getattr: a message that did not parse (handlers.Undecodable) has no request_id.
    return pb.AttendStreamResponse(
        request_id=getattr(request, "request_id", ""),
        error=pb.StreamError(code=code.value[0], message=message),
    )


def stream_answer(request: pb.AttendRequest, answer: WireMessage) -> WireMessage:
    """The AttendStreamResponse holding an answer: the request's id, then the answer."""
    envelope = pb.AttendStreamResponse(request_id=request.request_id)
    return WireMessage.of(envelope).add_message(STREAM_RESPONSE, answer)


class AttentionServicer(attention_pb2_grpc.AttentionServiceServicer):
    def __init__(
        self,
        plane: DataPlane,
        limits: InputLimits,
        *,
        max_stream_inflight_requests: int = DEFAULT_STREAM_INFLIGHT,
        max_stream_pending_bytes: int = DEFAULT_PENDING_BYTES,
        streams: StreamCloser | None = None,
        answers: AnswerBudget | None = None,
        shared_memory: bool = False,
        restrictions: Restrictions | None = None,
    ) -> None:
        self.restrictions = restrictions or Restrictions()
        self._plane = plane
        self.answers = answers  # None: answers are not bounded (tests of other parts)
        self._shared_memory = shared_memory  # client shared memory (the worker holds regions)
        self._limits = limits
        self._max_stream_inflight = max_stream_inflight_requests
        self._max_stream_pending_bytes = max_stream_pending_bytes
        self._stream_calls = StreamCalls(
            api=Api.ATTENTION_STREAM,
            answer=self._stream_answer,
            failure=stream_error,
            model_label=self.model_label,
            request_id=self.request_id,
            closer=streams,
            answer_bytes=self.answer_bytes,
            answers=answers,
            details=self.error_details,
        )

    @property
    def _registry(self) -> ModelRegistry[ServedModel]:
        return self._plane.models  # the served set changes: look it up at each call

    def answer_bytes(self, request: pb.AttendRequest) -> int:
        """The answer's size in the message, estimated before computing it: the output is as
        large as the input; the weights add h * seq float32 values per position; an answer
        asked for in client shared memory adds nothing. An input in client shared memory
        counts by its declared shape (within the limits)."""
        spec = self._registry.resolve(request.model, request.model_version).spec
        output, weights = answer_estimate(
            list(request.embeddings.shape),
            None if request.HasField("embeddings_region") else len(request.embeddings.data),
            itemsize=2 if request.embeddings.dtype == pb.FLOAT16 else 4,
            embed_dim=spec.embed_dim,
            num_heads=spec.num_heads,
            limits=self._limits,
            output=not request.HasField("output_region"),
            weights=request.return_attention_weights
            and not request.HasField("attention_weights_region"),
        )
        return output + weights

    def error_details(self, err: ServingError, context: grpc.aio.ServicerContext) -> str:
        return error_details(self.restrictions, err, context)

    def model_label(self, request: Any) -> str:
        if not hasattr(request, "model"):
            return SERVER_LABEL  # ListModels concerns no single model
        return self._registry.metric_label(request.model)

    def request_id(self, request: Any) -> str:
        return getattr(request, "request_id", "")

    @rpc(Api.ATTENTION, holds_answer=True)
    async def Attend(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        return await settled(await self._attend(request, context))

    async def AttendStream(
        self, requests: AsyncIterator[pb.AttendRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_stream(
            self._stream_calls,
            requests,
            context,
            max_inflight=self._max_stream_inflight,
            max_pending_bytes=self._max_stream_pending_bytes,
        )

    async def _stream_answer(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        return await settled(stream_answer(request, await self._attend(request, context)))

    async def _attend(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        """The one Attend path, unary and streamed: the AttendResponse, serialized with its
        tensors' bytes copied once (service.transport.wire)."""
        model = self._registry.resolve(request.model, request.model_version)
        refs = self._refs(request)  # first: with client shared memory off, that is the news
        if not request.HasField("embeddings"):
            raise InvalidInput("embeddings is missing; expected a Tensor [seq, d] or [n, seq, d]")
        received = _embeddings(request, refs["embeddings_region"])
        _check_weights_region(request, refs)
        # Answers go in the input's dtype, in a region as in the message (weights: float32).
        dtypes = {"output_region": received.dtype, "attention_weights_region": np.dtype("f4")}
        targets = {
            output: RegionTarget(ref, dtypes[field].newbyteorder("<"))
            for field, output in (
                ("output_region", "output"),
                ("attention_weights_region", "attention_weights"),
            )
            if (ref := refs[field]) is not None
        }
        result = await admit_and_run(
            self._plane,
            model,
            received,
            self._limits,
            with_weights=request.return_attention_weights,
            context=context,
            targets=targets,
        )
        try:
            # Encoded now: the answer's arrays may live in shared memory, freed by release().
            return await joined(encode_response(request, model, result, refs))
        finally:
            result.release()

    def _refs(self, request: pb.AttendRequest) -> dict[str, RegionRef | None]:
        """The request's client shared-memory references (the worker checks them against
        their regions)."""
        refs: dict[str, RegionRef | None] = {}
        for name in REGION_FIELDS:
            ref = getattr(request, name)
            enabled = self._shared_memory
            refs[name] = (
                shm_tensors.region_ref(ref.region, ref.offset, ref.byte_size, name, enabled)
                if request.HasField(name)
                else None
            )
        return refs

    @rpc(Api.ATTENTION)
    async def GetModel(
        self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        name = self._registry.resolve(request.model, "").spec.name
        return model_info(name, self._registry.versions(name), self._limits)

    @rpc(Api.ATTENTION)
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[
                model_info(name, self._registry.versions(name), self._limits)
                for name in self._registry.names()
            ]
        )


def encode_response(
    request: pb.AttendRequest,
    model: ServedModel,
    result: Result,
    refs: dict[str, RegionRef | None],
) -> WireMessage:
    """The AttendResponse: the tensors (their bytes copied once), then the other fields, in
    field-number order as protobuf writes the whole message and as the Go gateway writes it."""
    header = pb.AttendResponse(
        model=model.spec.name,
        model_version=str(model.spec.version),
        request_id=request.request_id,
        timing=pb.ServerTiming(
            queue_us=round(result.queue_s * 1e6),
            compute_us=round(result.compute_s * 1e6),
            batch_size=result.batch_size,
        ),
    )
    one = len(request.embeddings.shape) == 2  # [seq, d] in, [seq, d] out
    output = result.output[0] if one else result.output
    response = WireMessage().add_message(
        RESPONSE_OUTPUT, _tensor(output, _sent_dtype(request), refs["output_region"])
    )
    if result.attention_weights is not None:
        weights = result.attention_weights
        response.add_message(
            RESPONSE_WEIGHTS,
            _tensor(
                weights[0] if one else weights,
                np.dtype("float32"),
                refs["attention_weights_region"],
            ),
        )
    return response.add_serialized(header.SerializeToString(deterministic=True))


def _sent_dtype(request: pb.AttendRequest) -> np.dtype:
    """The dtype the client sent its embeddings in, which its answer comes back in."""
    return tensor_layout(request.embeddings, "embeddings")[1]


def _embeddings(request: pb.AttendRequest, ref: RegionRef | None) -> np.ndarray | RegionTensor:
    """The embeddings: a view of the message's bytes, or a reference to the client's region
    (a [seq, d] tensor as [1, seq, d])."""
    if ref is None:
        return decode_tensor(request.embeddings, "embeddings")
    if request.embeddings.data:
        raise InvalidInput("embeddings has data and embeddings_region names a region; send one")
    shape, dtype = tensor_layout(request.embeddings, "embeddings")
    if len(shape) not in (2, 3):
        raise InvalidInput(f"embeddings has shape {shape}; expected [seq, d] or [n, seq, d]")
    batch_shape = shape if len(shape) == 3 else [1, *shape]
    return shm_tensors.input_tensor(ref, batch_shape, dtype)


def _check_weights_region(request: pb.AttendRequest, refs: dict[str, RegionRef | None]) -> None:
    if refs["attention_weights_region"] is not None and not request.return_attention_weights:
        raise InvalidInput("attention_weights_region is set but return_attention_weights is false")


def _tensor(array: np.ndarray, dtype: np.dtype, ref: RegionRef | None) -> WireMessage:
    """An answer tensor: its bytes in the message, or (written into the client's region by
    the worker) its shape and dtype alone."""
    if ref is None:
        return encode_tensor_wire(array, dtype)
    return WireMessage.of(pb.Tensor(shape=list(array.shape), dtype=wire_dtype(dtype)))
