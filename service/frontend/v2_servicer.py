"""inference.GRPCInferenceService (Open Inference Protocol / KServe V2) on the same batcher.

Thin: each RPC decodes nothing beyond its protobuf and calls the V2Plane the HTTP/REST front
end calls too."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from service.catalog import SERVER_LABEL, ModelRegistry, ServedModel
from service.dataplane import DataPlane
from service.errors import ServingError
from service.frontend import log_settings
from service.frontend.caller import caller
from service.frontend.delivery import AnswerBudget
from service.frontend.restricted import Restrictions, error_details
from service.frontend.rpc import rpc
from service.frontend.streaming import StreamCalls, StreamCloser, serve_stream
from service.frontend.v2_codec import encode_response
from service.frontend.v2_plane import V2Plane
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from service.observability.metrics import Api
from service.settings import Settings
from service.text import shown
from service.transport.wire import WireMessage, joined, settled

log = logging.getLogger(__name__)

STREAM_INFER_RESPONSE = v2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name[
    "infer_response"
].number
# Requests whose name field names a shared-memory region, not a model.
REGION_REQUESTS = (
    v2.SystemSharedMemoryStatusRequest,
    v2.SystemSharedMemoryRegisterRequest,
    v2.SystemSharedMemoryUnregisterRequest,
)


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        plane: DataPlane,
        settings: Settings,
        is_ready: Callable[[], bool],
        *,
        streams: StreamCloser | None = None,
        v2_plane: V2Plane | None = None,
        answers: AnswerBudget | None = None,
        restrictions: Restrictions | None = None,
    ) -> None:
        self.restrictions = restrictions or Restrictions()
        self.answers = answers  # None: answers are not bounded (tests of other parts)
        self.plane = v2_plane or V2Plane(plane, settings, is_ready)
        self._settings = settings
        self._limits = self.plane.limits
        self._stream_calls = StreamCalls(
            api=Api.V2_STREAM,
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
        return self.plane.registry

    def answer_bytes(self, request: v2.ModelInferRequest) -> int:
        return self.plane.answer_bytes(request)

    def error_details(self, err: ServingError, context: grpc.aio.ServicerContext) -> str:
        return error_details(self.restrictions, err, context)

    def model_label(self, request: Any) -> str:
        if isinstance(request, REGION_REQUESTS) or (
            not hasattr(request, "model_name") and not hasattr(request, "name")
        ):
            return SERVER_LABEL  # ServerLive and friends concern no model
        name = getattr(request, "model_name", "") or getattr(request, "name", "")
        return self._registry.metric_label(name)

    def request_id(self, request: Any) -> str:
        return getattr(request, "id", "")

    @rpc(Api.V2)
    async def ServerLive(
        self, request: v2.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> v2.ServerLiveResponse:
        return v2.ServerLiveResponse(live=True)

    @rpc(Api.V2)
    async def ServerReady(
        self, request: v2.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> v2.ServerReadyResponse:
        return v2.ServerReadyResponse(ready=self.plane.is_ready())

    @rpc(Api.V2)
    async def ModelReady(
        self, request: v2.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelReadyResponse:
        return v2.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version))

    @rpc(Api.V2)
    async def ServerMetadata(
        self, request: v2.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> v2.ServerMetadataResponse:
        return self.plane.server_metadata()

    @rpc(Api.V2)
    async def ModelMetadata(
        self, request: v2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelMetadataResponse:
        return self.plane.model_metadata(request.name, request.version)

    @rpc(Api.V2)
    async def ModelConfig(
        self, request: v2.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelConfigResponse:
        return self.plane.model_config(request.name, request.version)

    @rpc(Api.V2)
    async def ModelStatistics(
        self, request: v2.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelStatisticsResponse:
        return await self.plane.statistics(request.name, request.version)

    @rpc(Api.V2)
    async def RepositoryIndex(
        self, request: v2.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> v2.RepositoryIndexResponse:
        return await self.plane.repository_index(request.repository_name, ready=request.ready)

    @rpc(Api.V2)
    async def RepositoryModelLoad(
        self, request: v2.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> v2.RepositoryModelLoadResponse:
        who = caller(context)
        log.info("RepositoryModelLoad %s asked by %s", shown(request.model_name), who)
        await self.plane.load(request.repository_name, request.model_name, request.parameters, who)
        return v2.RepositoryModelLoadResponse()

    @rpc(Api.V2)
    async def RepositoryModelUnload(
        self, request: v2.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> v2.RepositoryModelUnloadResponse:
        who = caller(context)
        log.info("RepositoryModelUnload %s asked by %s", shown(request.model_name), who)
        await self.plane.unload(
            request.repository_name, request.model_name, request.parameters, who
        )
        return v2.RepositoryModelUnloadResponse()

    # The system shared-memory extension: the shared-memory group of --restricted-api.
    @rpc(Api.V2)
    async def SystemSharedMemoryStatus(
        self, request: v2.SystemSharedMemoryStatusRequest, context: grpc.aio.ServicerContext
    ) -> v2.SystemSharedMemoryStatusResponse:
        return await self.plane.shm_status(request.name)

    @rpc(Api.V2)
    async def SystemSharedMemoryRegister(
        self, request: v2.SystemSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ) -> v2.SystemSharedMemoryRegisterResponse:
        await self.plane.shm_register(request.name, request.key, request.offset, request.byte_size)
        return v2.SystemSharedMemoryRegisterResponse()

    @rpc(Api.V2)
    async def SystemSharedMemoryUnregister(
        self, request: v2.SystemSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ) -> v2.SystemSharedMemoryUnregisterResponse:
        await self.plane.shm_unregister(request.name)
        return v2.SystemSharedMemoryUnregisterResponse()

    # The logging extension: the logging group of --restricted-api.
    @rpc(Api.V2)
    async def LogSettings(
        self, request: v2.LogSettingsRequest, context: grpc.aio.ServicerContext
    ) -> v2.LogSettingsResponse:
        changes = log_settings.from_proto(request)
        if not changes:
            return log_settings.to_proto(self.plane.log_settings())
        return log_settings.to_proto(self.plane.update_log_settings(changes, caller(context)))

    @rpc(Api.V2, holds_answer=True)
    async def ModelInfer(
        self, request: v2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        return await settled(await self._infer(request, context))

    async def ModelStreamInfer(
        self, requests: AsyncIterator[v2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_stream(
            self._stream_calls,
            requests,
            context,
            max_inflight=self._settings.max_stream_inflight_requests,
            max_pending_bytes=self._settings.max_stream_pending_bytes,
        )

    async def _stream_answer(
        self, request: v2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        return await settled(stream_answer(await self._infer(request, context)))

    async def _infer(
        self, request: v2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        """The one ModelInfer path, unary and streamed."""
        inferred = await self.plane.infer(request, context)
        try:
            # Encoded now: the answer's arrays may live in shared memory, freed by release().
            return await joined(
                encode_response(
                    request, inferred.model, inferred.names, inferred.result, inferred.refs
                )
            )
        finally:
            inferred.result.release()


def stream_answer(answer: WireMessage) -> WireMessage:
    """The ModelStreamInferResponse holding an answer."""
    return WireMessage().add_message(STREAM_INFER_RESPONSE, answer)


def stream_error(
    request: v2.ModelInferRequest, code: grpc.StatusCode, message: str
) -> v2.ModelStreamInferResponse:
    """Triton's stream error: a message (no status code field), and the request's id and
    model so the client can tell which request failed."""
    # getattr: a message that did not parse (handlers.Undecodable) has none of these.
    return v2.ModelStreamInferResponse(
        error_message=message,
        infer_response=v2.ModelInferResponse(
            id=getattr(request, "id", ""),
            model_name=getattr(request, "model_name", ""),
            model_version=getattr(request, "model_version", ""),
        ),
    )
