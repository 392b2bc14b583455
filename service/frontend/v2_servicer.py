"""inference.GRPCInferenceService (Open Inference Protocol / KServe V2) on the same batcher."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from service.errors import InvalidInput, ModelNotFound, NotSupported
from service.frontend.admission import admit_and_run
from service.frontend.caller import caller
from service.frontend.delivery import AnswerBudget
from service.frontend.rpc import rpc
from service.frontend.streaming import StreamCalls, StreamCloser, serve_stream
from service.frontend.v2_codec import (
    INPUT_NAME,
    V2_NAME_OF,
    accepted_datatypes,
    decode_input,
    encode_response,
    refuse_parameters,
    requested_outputs,
)
from service.frontend.validation import InputLimits
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from service.generated.inference import model_config_pb2 as config
from service.settings import Settings
from service.text import shown
from service.transport.wire import WireMessage, settled
from service.worker.batching.batcher import Batcher
from service.worker.batching.statistics import Duration
from service.worker.engine.model_control import ModelController, check_repository_name
from service.worker.engine.onnx_model import OnnxModel
from service.worker.engine.registry import SERVER_LABEL, ModelRegistry
from service.worker.engine.repository import VersionPolicy

log = logging.getLogger(__name__)

API = "v2"
STREAM_INFER_RESPONSE = v2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name[
    "infer_response"
].number
STREAM_API = "v2_stream"
SERVER_NAME = "attention-serving"
PLATFORM = "onnxruntime_onnx"
# Triton's names; model_repository: RepositoryIndex / RepositoryModelLoad / RepositoryModelUnload.
EXTENSIONS = ["model_configuration", "statistics", "model_repository"]
# RepositoryModelUnload parameters taken (tritonclient always sends it; there are no
# dependent models here, so it changes nothing).
UNLOAD_PARAMETERS = {"unload_dependents"}
CONFIG_TYPES = {"FP32": config.TYPE_FP32, "FP16": config.TYPE_FP16}


def _server_version() -> str:
    try:
        return importlib.metadata.version(SERVER_NAME)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _stat(duration: Duration) -> v2.StatisticDuration:
    return v2.StatisticDuration(count=duration.count, ns=duration.ns)


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        batcher: Batcher,
        settings: Settings,
        is_ready: Callable[[], bool],
        *,
        streams: StreamCloser | None = None,
        repository: ModelController | None = None,
        answers: AnswerBudget | None = None,
    ) -> None:
        self.answers = answers  # None: answers are not bounded (tests of other parts)
        self._registry = registry
        self._repository = repository
        self._batcher = batcher
        self._settings = settings
        self._limits = InputLimits(settings.max_seq_len, settings.max_batch_size)
        self._is_ready = is_ready
        self._stream_calls = StreamCalls(
            api=STREAM_API,
            answer=self._stream_answer,
            failure=_stream_error,
            model_label=self.model_label,
            request_id=self.request_id,
            closer=streams,
            answer_bytes=self.answer_bytes,
            answers=answers,
        )

    def answer_bytes(self, request: v2.ModelInferRequest) -> int:
        """The answer's size, estimated before computing it: the output is as large as the
        input; the weights, when asked for, add h * seq float32 values per position."""
        tensor = request.inputs[0]
        payload = sum(len(raw) for raw in request.raw_input_contents)
        payload += 4 * len(tensor.contents.fp32_contents)
        if all(output.name != "attention_weights" for output in request.outputs):
            return payload
        spec = self._registry.resolve(request.model_name, request.model_version).spec
        itemsize = 2 if tensor.datatype == "FP16" else 4
        positions = payload // (spec.embed_dim * itemsize)
        seq = min(list(tensor.shape)[-2:][0], self._limits.max_seq_len)
        return payload + positions * spec.num_heads * seq * 4

    def model_label(self, request: Any) -> str:
        if not hasattr(request, "model_name") and not hasattr(request, "name"):
            return SERVER_LABEL  # ServerLive and friends concern no model
        name = getattr(request, "model_name", "") or getattr(request, "name", "")
        return self._registry.metric_label(name)

    def request_id(self, request: Any) -> str:
        return getattr(request, "id", "")

    @rpc(API)
    async def ServerLive(
        self, request: v2.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> v2.ServerLiveResponse:
        return v2.ServerLiveResponse(live=True)

    @rpc(API)
    async def ServerReady(
        self, request: v2.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> v2.ServerReadyResponse:
        return v2.ServerReadyResponse(ready=self._is_ready())

    @rpc(API)
    async def ModelReady(
        self, request: v2.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelReadyResponse:
        try:
            self._registry.resolve(request.name, request.version)
        except ModelNotFound:
            return v2.ModelReadyResponse(ready=False)
        return v2.ModelReadyResponse(ready=self._is_ready())

    @rpc(API)
    async def ServerMetadata(
        self, request: v2.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> v2.ServerMetadataResponse:
        return v2.ServerMetadataResponse(
            name=SERVER_NAME, version=_server_version(), extensions=EXTENSIONS
        )

    @rpc(API)
    async def ModelMetadata(
        self, request: v2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelMetadataResponse:
        model = self._registry.resolve(request.name, request.version)
        spec, datatype = model.spec, V2_NAME_OF[model.spec.dtype]
        tensor = v2.ModelMetadataResponse.TensorMetadata
        return v2.ModelMetadataResponse(
            name=spec.name,
            versions=[str(m.spec.version) for m in self._registry.versions(spec.name)],
            platform=PLATFORM,
            inputs=[tensor(name=INPUT_NAME, datatype=datatype, shape=[-1, -1, spec.embed_dim])],
            outputs=[
                tensor(name="output", datatype=datatype, shape=[-1, -1, spec.embed_dim]),
                tensor(
                    name="attention_weights", datatype="FP32", shape=[-1, spec.num_heads, -1, -1]
                ),
            ],
        )

    @rpc(API)
    async def ModelConfig(
        self, request: v2.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelConfigResponse:
        model = self._registry.resolve(request.name, request.version)
        spec, datatype = model.spec, CONFIG_TYPES[V2_NAME_OF[model.spec.dtype]]
        return v2.ModelConfigResponse(
            config=config.ModelConfig(
                name=spec.name,
                platform=PLATFORM,
                backend="onnxruntime",
                version_policy=_version_policy(self._settings.version_policy),
                max_batch_size=self._settings.max_batch_size,
                input=[
                    config.ModelInput(
                        name=INPUT_NAME, data_type=datatype, dims=[-1, spec.embed_dim]
                    )
                ],
                output=[
                    config.ModelOutput(
                        name="output", data_type=datatype, dims=[-1, spec.embed_dim]
                    ),
                    config.ModelOutput(
                        name="attention_weights",
                        data_type=config.TYPE_FP32,
                        dims=[spec.num_heads, -1, -1],
                    ),
                ],
                dynamic_batching=config.ModelDynamicBatching(
                    # Triton's preferred sizes: here, the measured caps (see "batch_caps").
                    preferred_batch_size=sorted({size for _, size in model.batch_caps.caps}),
                    max_queue_delay_microseconds=round(self._settings.max_queue_delay_ms * 1000),
                ),
                parameters={
                    # V2 metadata names one datatype per input; this says what else is taken.
                    "accepted_input_datatypes": config.ModelParameter(
                        string_value=",".join(accepted_datatypes(model))
                    ),
                    "batch_caps": config.ModelParameter(
                        string_value=",".join(
                            f"{length}:{size}" for length, size in model.batch_caps.caps
                        )
                    ),
                },
            )
        )

    @rpc(API)
    async def ModelStatistics(
        self, request: v2.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> v2.ModelStatisticsResponse:
        if request.name:
            models = [self._registry.resolve(request.name, request.version)]
            if not request.version:
                models = self._registry.versions(models[0].spec.name)
        else:
            models = self._registry.all()
        return v2.ModelStatisticsResponse(model_stats=[self._statistics(model) for model in models])

    def _statistics(self, model: OnnxModel) -> v2.ModelStatistics:
        stats = self._batcher.statistics.snapshot(model.key)
        return v2.ModelStatistics(
            name=model.spec.name,
            version=str(model.spec.version),
            last_inference=stats.last_inference_ms,
            inference_count=stats.inference_count,
            execution_count=stats.execution_count,
            inference_stats=v2.InferStatistics(
                success=_stat(stats.success),
                fail=_stat(stats.fail),
                queue=_stat(stats.queue),
                compute_infer=_stat(stats.compute_infer),
            ),
            batch_stats=[
                v2.InferBatchStatistics(batch_size=size, compute_infer=_stat(duration))
                for size, duration in sorted(stats.batches.items())
            ],
        )

    @rpc(API)
    async def RepositoryIndex(
        self, request: v2.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> v2.RepositoryIndexResponse:
        check_repository_name(request.repository_name)
        entries = await self._control().index(ready_only=request.ready)
        index = v2.RepositoryIndexResponse.ModelIndex
        return v2.RepositoryIndexResponse(
            models=[
                index(name=e.name, version=str(e.version), state=e.state, reason=e.reason)
                for e in entries
            ]
        )

    @rpc(API)
    async def RepositoryModelLoad(
        self, request: v2.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> v2.RepositoryModelLoadResponse:
        check_repository_name(request.repository_name)
        if request.parameters:
            raise InvalidInput(
                f"RepositoryModelLoad parameters {_names(request.parameters)} are not "
                "supported (no config or file overrides): load the files in the repository"
            )
        log.info("RepositoryModelLoad %s asked by %s", shown(request.model_name), caller(context))
        await self._control().load(request.model_name)
        return v2.RepositoryModelLoadResponse()

    @rpc(API)
    async def RepositoryModelUnload(
        self, request: v2.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> v2.RepositoryModelUnloadResponse:
        check_repository_name(request.repository_name)
        unknown = set(request.parameters) - UNLOAD_PARAMETERS
        if unknown:
            raise InvalidInput(
                f"RepositoryModelUnload parameters {_names(unknown)} are not supported; "
                f"expected only {sorted(UNLOAD_PARAMETERS)}"
            )
        log.info("RepositoryModelUnload %s asked by %s", shown(request.model_name), caller(context))
        await self._control().unload(request.model_name)
        return v2.RepositoryModelUnloadResponse()

    def _control(self) -> ModelController:
        if self._repository is None:
            raise NotSupported("this server was started without a model repository controller")
        return self._repository

    @rpc(API, holds_answer=True)
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
        answer = WireMessage().add_message(
            STREAM_INFER_RESPONSE, await self._infer(request, context)
        )
        return await settled(answer)

    async def _infer(
        self, request: v2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> WireMessage:
        """The one ModelInfer path, unary and streamed."""
        model = self._registry.resolve(request.model_name, request.model_version)
        refuse_parameters(request)
        names = requested_outputs(request, model)
        received = decode_input(request, model)
        result = await admit_and_run(
            self._batcher,
            model,
            received,
            self._limits,
            with_weights="attention_weights" in names,
            context=context,
        )
        return encode_response(request, model, names, result)


def _names(keys: Iterable[str]) -> str:
    """Client-sent parameter names, bounded and escaped for a message."""
    names = sorted(keys)
    return ", ".join(shown(name) for name in names[:4]) + (" ..." if len(names) > 4 else "")


def _version_policy(text: str) -> config.ModelVersionPolicy:
    """--version-policy as Triton's ModelConfig writes it."""
    policy, latest = config.ModelVersionPolicy, VersionPolicy.parse(text).latest
    if latest is not None:
        return policy(latest=policy.Latest(num_versions=latest))
    return policy(all=policy.All())


def _stream_error(
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
