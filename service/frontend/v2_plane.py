"""The Open Inference Protocol's operations, shared by its gRPC servicer and the HTTP/REST
front end: each takes and returns the V2 protobuf messages, so the two cannot drift."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from service.catalog import (
    ModelRegistry,
    ServedModel,
    VersionPolicy,
    check_repository_name,
)
from service.dataplane import (
    DataPlane,
    Duration,
    RegionRef,
    RegionTarget,
    Result,
    VersionStats,
)
from service.errors import InvalidInput, ModelNotFound, NotSupported
from service.frontend.admission import HasDeadline, WithTimeout, admit_and_run
from service.frontend.log_settings import LogControl, Value
from service.frontend.shm_tensors import PARAMETERS
from service.frontend.v2_codec import (
    INPUT_NAME,
    OUTPUT_NAME,
    V2_NAME_OF,
    WEIGHTS_DTYPE,
    WEIGHTS_NAME,
    accepted_datatypes,
    decode_input,
    output_refs,
    refuse_parameters,
    request_timeout_s,
    requested_outputs,
)
from service.frontend.validation import InputLimits, answer_estimate
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import model_config_pb2 as config
from service.settings import Settings
from service.text import shown

SERVER_NAME = "attention-serving"
PLATFORM = "onnxruntime_onnx"
# Triton's names; model_repository: RepositoryIndex / RepositoryModelLoad / RepositoryModelUnload.
# binary_tensor_data: REST's binary tensors (Triton lists it on both protocols, as here).
EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "model_repository",
    "logging",
]
SHARED_MEMORY_EXTENSION = "system_shared_memory"
SHARED_MEMORY_OFF = (
    "system shared memory is off on this server; start it with --client-shared-memory on "
    "(for clients on the same host)"
)
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


def _statistics(model: ServedModel, stats: VersionStats) -> v2.ModelStatistics:
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


@dataclass(frozen=True)
class Inferred:
    """A computed ModelInfer: what encoding its response needs."""

    model: ServedModel
    names: list[str]  # outputs asked for, in order
    result: Result
    refs: dict[str, RegionRef]  # outputs written into client shared memory, by name


class V2Plane:
    """Health, metadata, config, statistics, repository and inference of the V2 protocol."""

    def __init__(
        self,
        plane: DataPlane,
        settings: Settings,
        is_ready: Callable[[], bool],
        *,
        log_control: LogControl | None = None,
    ) -> None:
        self._plane = plane
        self._settings = settings
        # Every process's log settings (this process's alone without a run directory).
        self._log_control = log_control or LogControl(None)
        self.limits = InputLimits(settings.max_seq_len, settings.max_batch_size)
        self.is_ready = is_ready
        # Client shared memory: the worker holds the regions; this relays the calls.
        self.shared_memory = settings.client_shared_memory == "on"

    @property
    def registry(self) -> ModelRegistry[ServedModel]:
        return self._plane.models  # the served set changes: look it up at each call

    def model_ready(self, name: str, version: str) -> bool:
        try:
            self.registry.resolve(name, version)
        except ModelNotFound:
            return False
        return self.is_ready()

    def server_metadata(self) -> v2.ServerMetadataResponse:
        extensions = EXTENSIONS + ([SHARED_MEMORY_EXTENSION] if self.shared_memory else [])
        return v2.ServerMetadataResponse(
            name=SERVER_NAME, version=_server_version(), extensions=extensions
        )

    def log_settings(self) -> dict[str, Value]:
        """Triton's log settings, as every process logs now."""
        return self._log_control.view()

    def update_log_settings(self, changes: Mapping[str, Any], who: str) -> dict[str, Value]:
        """Change the log settings of every process; the settings in force after the change."""
        return self._log_control.update(changes, who)

    def model_metadata(self, name: str, version: str) -> v2.ModelMetadataResponse:
        model = self.registry.resolve(name, version)
        spec, datatype = model.spec, V2_NAME_OF[model.spec.dtype]
        tensor = v2.ModelMetadataResponse.TensorMetadata
        return v2.ModelMetadataResponse(
            name=spec.name,
            versions=[str(m.spec.version) for m in self.registry.versions(spec.name)],
            platform=PLATFORM,
            inputs=[tensor(name=INPUT_NAME, datatype=datatype, shape=[-1, -1, spec.embed_dim])],
            outputs=[
                tensor(name="output", datatype=datatype, shape=[-1, -1, spec.embed_dim]),
                tensor(
                    name="attention_weights", datatype="FP32", shape=[-1, spec.num_heads, -1, -1]
                ),
            ],
        )

    def model_config(self, name: str, version: str) -> v2.ModelConfigResponse:
        model = self.registry.resolve(name, version)
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

    async def statistics(self, name: str, version: str) -> v2.ModelStatisticsResponse:
        registry = self.registry
        if name:
            models = [registry.resolve(name, version)]
            if not version:
                models = registry.versions(models[0].spec.name)
        else:
            models = registry.all()
        found = await self._plane.statistics([model.key for model in models])
        return v2.ModelStatisticsResponse(
            model_stats=[_statistics(model, found[model.key]) for model in models]
        )

    async def repository_index(self, repository: str, *, ready: bool) -> v2.RepositoryIndexResponse:
        check_repository_name(repository)
        entries = await self._plane.index(ready_only=ready)
        index = v2.RepositoryIndexResponse.ModelIndex
        return v2.RepositoryIndexResponse(
            models=[
                index(name=e.name, version=str(e.version), state=e.state, reason=e.reason)
                for e in entries
            ]
        )

    async def load(
        self, repository: str, name: str, parameters: Iterable[str], asked_by: str
    ) -> None:
        """Load name; asked_by (who asked, as logged) goes to the worker's log line too."""
        check_repository_name(repository)
        names = list(parameters)
        if names:
            raise InvalidInput(
                f"RepositoryModelLoad parameters {_names(names)} are not "
                "supported (no config or file overrides): load the files in the repository"
            )
        await self._plane.load(name, asked_by)

    async def unload(
        self, repository: str, name: str, parameters: Iterable[str], asked_by: str
    ) -> None:
        check_repository_name(repository)
        unknown = set(parameters) - UNLOAD_PARAMETERS
        if unknown:
            raise InvalidInput(
                f"RepositoryModelUnload parameters {_names(unknown)} are not supported; "
                f"expected only {sorted(UNLOAD_PARAMETERS)}"
            )
        await self._plane.unload(name, asked_by)

    async def infer(self, request: v2.ModelInferRequest, context: HasDeadline) -> Inferred:
        """The one ModelInfer path: gRPC unary, gRPC streamed, and HTTP/REST."""
        model = self.registry.resolve(request.model_name, request.model_version)
        refuse_parameters(request, shared_memory=self.shared_memory)
        timeout_s = request_timeout_s(request)
        if timeout_s is not None:
            context = WithTimeout(context, timeout_s)
        names = requested_outputs(request, model)
        refs = output_refs(request, self.shared_memory)
        received = decode_input(request, model, self.shared_memory)
        # V2 answers in the model's dtype (the weights in float32), in the region as here.
        dtypes = {OUTPUT_NAME: model.spec.dtype, WEIGHTS_NAME: WEIGHTS_DTYPE}
        result = await admit_and_run(
            self._plane,
            model,
            received,
            self.limits,
            with_weights="attention_weights" in names,
            context=context,
            targets={
                name: RegionTarget(ref, dtypes[name].newbyteorder("<"))
                for name, ref in refs.items()
                if name in names
            },
        )
        return Inferred(model, names, result, refs)

    def answer_bytes(self, request: v2.ModelInferRequest) -> int:
        """The answer's size in the message, estimated before computing it (the
        undelivered-answers budget reserves it)."""
        return sum(nbytes for nbytes, _ in self.answer_sizes(request).values())

    def answer_sizes(self, request: v2.ModelInferRequest) -> dict[str, tuple[int, int]]:
        """(bytes, bytes per value) of each output the answer carries in the message,
        estimated before computing it: the output, when asked for (or nothing is named), is
        as large as the input; the weights, when asked for, add h * seq float32 values per
        position; an output asked for in client shared memory carries nothing. An input in
        client shared memory counts by its declared shape (within the limits). Nothing for a
        request with no input (infer refuses it, saying so)."""
        if not request.inputs:
            return {}
        tensor = request.inputs[0]
        itemsize = 2 if tensor.datatype == "FP16" else 4
        in_region = {o.name for o in request.outputs if PARAMETERS.intersection(o.parameters)}
        payload = None
        if not PARAMETERS.intersection(tensor.parameters):
            payload = sum(len(raw) for raw in request.raw_input_contents)
            payload += 4 * len(tensor.contents.fp32_contents)
        wants_weights = any(o.name == "attention_weights" for o in request.outputs)
        # Outputs named: the answer carries those alone (none named: 'output' alone).
        wants_output = not request.outputs or any(o.name == "output" for o in request.outputs)
        carries_output = wants_output and "output" not in in_region
        # An unknown model or version raises here (and reserves nothing): NOT_FOUND follows.
        spec = self.registry.resolve(request.model_name, request.model_version).spec
        if payload is not None and carries_output and not wants_weights and not in_region:
            return {"output": (payload, itemsize)}  # the common case: as large as the input
        output, weights = answer_estimate(
            list(tensor.shape),
            payload,
            itemsize=itemsize,
            embed_dim=spec.embed_dim,
            num_heads=spec.num_heads,
            limits=self.limits,
            output=carries_output,
            weights=wants_weights and "attention_weights" not in in_region,
        )
        sizes = {"output": (output, itemsize)} if carries_output else {}
        if weights or (wants_weights and "attention_weights" not in in_region):
            sizes["attention_weights"] = (weights, 4)
        return sizes

    # -- the system shared-memory extension (the shared-memory group of --restricted-api) --

    def _check_shared_memory(self) -> None:
        if not self.shared_memory:
            raise NotSupported(SHARED_MEMORY_OFF)

    async def shm_status(self, name: str) -> v2.SystemSharedMemoryStatusResponse:
        self._check_shared_memory()
        status = v2.SystemSharedMemoryStatusResponse.RegionStatus
        return v2.SystemSharedMemoryStatusResponse(
            regions={
                region: status(name=region, key=key, offset=offset, byte_size=byte_size)
                for region, key, offset, byte_size in await self._plane.shm_status(name)
            }
        )

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_shared_memory()
        await self._plane.shm_register(name, key, offset, byte_size)

    async def shm_unregister(self, name: str) -> None:
        self._check_shared_memory()
        await self._plane.shm_unregister(name)


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
