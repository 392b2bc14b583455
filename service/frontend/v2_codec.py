"""Open Inference Protocol (V2) tensors <-> numpy, with V2-style error messages."""

from __future__ import annotations

import functools
import math

import numpy as np

from service.catalog import ServedModel
from service.dataplane import RegionRef, RegionTensor, Result
from service.errors import InvalidInput
from service.frontend import shm_tensors
from service.generated.inference import grpc_service_pb2 as v2
from service.text import model_reference, shown, shown_shape
from service.transport.codec import checked_shape
from service.transport.wire import WireMessage, array_bytes

INPUT_NAME = "embeddings"
OUTPUT_NAME, WEIGHTS_NAME = "output", "attention_weights"
RAW_OUTPUT_CONTENTS = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
RESPONSE_ID = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["id"].number
OUTPUT_NAMES = (OUTPUT_NAME, WEIGHTS_NAME)
# The attention weights come back in float32, whatever the model's dtype.
WEIGHTS_DTYPE = np.dtype("<f4")
V2_DATATYPES: dict[str, np.dtype] = {"FP32": np.dtype("<f4"), "FP16": np.dtype("<f2")}
V2_NAME_OF = {np.dtype("float32"): "FP32", np.dtype("float16"): "FP16"}
# Triton's schedule-policy timeout: microseconds the request may wait before it is computed
# (0: no bound); past it the request leaves the queue, DEADLINE_EXCEEDED (REST: 504), as at a
# gRPC deadline. The only deadline a REST call can carry.
TIMEOUT_PARAMETER = "timeout"
# Parameters that change nothing here and that clients send as a matter of course (the HTTP
# flavour of tritonclient marks binary data this way), and the timeout; any other parameter
# asks for something this server does not do (classification, shared memory, sequences,
# priority), so it is refused rather than silently ignored. The shared-memory parameters are
# taken when client shared memory is on (service/frontend/shm_tensors.py).
TOLERATED_REQUEST_PARAMETERS = frozenset({"binary_data_output", TIMEOUT_PARAMETER})
TOLERATED_INPUT_PARAMETERS = frozenset({"binary_data_size"})
TOLERATED_OUTPUT_PARAMETERS = frozenset({"binary_data"})
TYPED_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp64_contents",
    "bytes_contents",
)


def _model_ref(model: ServedModel) -> str:
    return model_reference(model.spec.name, model.spec.version)


def _single_input(
    request: v2.ModelInferRequest, model: ServedModel
) -> v2.ModelInferRequest.InferInputTensor:
    if len(request.inputs) == 1 and request.inputs[0].name == INPUT_NAME:
        return request.inputs[0]
    names = [shown(tensor.name) for tensor in request.inputs[:4]]
    if len(request.inputs) != 1:
        listed = f": {', '.join(names)}{' ...' if len(request.inputs) > 4 else ''}" if names else ""
        raise InvalidInput(
            f"expected 1 input ('{INPUT_NAME}') for {_model_ref(model)}, got "
            f"{len(request.inputs)}{listed}"
        )
    if request.inputs[0].name != INPUT_NAME:
        raise InvalidInput(
            f"unexpected inference input {names[0]} for {_model_ref(model)};"
            f" expected '{INPUT_NAME}'"
        )
    return request.inputs[0]


def refuse_parameters(request: v2.ModelInferRequest, *, shared_memory: bool = False) -> None:
    """InvalidInput naming the first parameter this server would otherwise ignore."""
    if not (
        request.parameters
        or any(t.parameters for t in request.inputs)
        or any(t.parameters for t in request.outputs)
    ):
        return  # the common case, checked without building the messages
    shm = shm_tensors.PARAMETERS if shared_memory else frozenset()
    places = [("request", request.parameters, TOLERATED_REQUEST_PARAMETERS)]
    places += [
        (f"input {shown(t.name)}", t.parameters, TOLERATED_INPUT_PARAMETERS | shm)
        for t in request.inputs
    ]
    places += [
        (f"output {shown(t.name)}", t.parameters, TOLERATED_OUTPUT_PARAMETERS | shm)
        for t in request.outputs
    ]
    for place, parameters, tolerated in places:
        unknown = sorted(set(parameters) - tolerated)
        if unknown and unknown[0] in shm_tensors.PARAMETERS:
            raise InvalidInput(f"{place} has parameter {unknown[0]}: {shm_tensors.OFF}")
        if unknown:
            raise InvalidInput(
                f"{place} has parameter {shown(unknown[0])}, which this server does not "
                f"implement; parameters accepted: {sorted(tolerated)}"
            )


def request_timeout_s(request: v2.ModelInferRequest) -> float | None:
    """The request's timeout parameter in seconds; None without one (or 0: no bound)."""
    if TIMEOUT_PARAMETER not in request.parameters:
        return None
    parameter = request.parameters[TIMEOUT_PARAMETER]
    kind = parameter.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param") and getattr(parameter, kind) >= 0:
        microseconds: int = getattr(parameter, kind)
        return microseconds / 1e6 if microseconds else None
    given = {
        "int64_param": str(parameter.int64_param),
        "double_param": repr(parameter.double_param),
        "bool_param": str(parameter.bool_param).lower(),
        "string_param": shown(parameter.string_param),
    }.get(kind or "", "empty")
    raise InvalidInput(
        f"request parameter 'timeout' is {given}; expected microseconds as a non-negative "
        "integer (0: no timeout)"
    )


def _shared_input(
    request: v2.ModelInferRequest, tensor, dtype: np.dtype, ref: RegionRef
) -> RegionTensor:
    where = f"input '{INPUT_NAME}'"
    if request.raw_input_contents or tensor.HasField("contents"):
        raise InvalidInput(f"{where} names a shared-memory region and carries data; send one")
    return shm_tensors.input_tensor(ref, checked_shape(list(tensor.shape), where), dtype)


def _input_array(request: v2.ModelInferRequest, tensor, dtype: np.dtype) -> np.ndarray:
    shape = checked_shape(list(tensor.shape), f"input '{INPUT_NAME}'")
    elements = math.prod(shape)
    has_typed = tensor.HasField("contents")
    if request.raw_input_contents and has_typed:
        raise InvalidInput(
            f"input '{INPUT_NAME}' has both raw_input_contents and typed contents; send one"
        )
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(request.inputs):
            raise InvalidInput(
                f"{len(request.raw_input_contents)} raw_input_contents for "
                f"{len(request.inputs)} inputs; expected one per input"
            )
        raw = request.raw_input_contents[0]
        if len(raw) != elements * dtype.itemsize:
            raise InvalidInput(
                f"input '{INPUT_NAME}' has {len(raw)} bytes of raw data;"
                f" shape {shape} of {tensor.datatype} needs {elements * dtype.itemsize} bytes"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    if has_typed:
        if dtype != np.float32:
            raise InvalidInput(
                f"input '{INPUT_NAME}': typed contents carry FP32 only;"
                f" send {tensor.datatype} as raw_input_contents"
            )
        values = tensor.contents.fp32_contents
        misplaced = [f for f in TYPED_FIELDS if len(getattr(tensor.contents, f))]
        if misplaced:
            raise InvalidInput(
                f"input '{INPUT_NAME}' carries its values in contents.{misplaced[0]}; "
                f"{tensor.datatype} values go in contents.fp32_contents or raw_input_contents"
            )
        if len(values) != elements:
            raise InvalidInput(
                f"input '{INPUT_NAME}' has {len(values)} fp32_contents values;"
                f" shape {shape} needs {elements}"
            )
        return np.asarray(values, dtype=np.float32).reshape(shape)
    raise InvalidInput(
        f"input '{INPUT_NAME}' has no data; send raw_input_contents or contents.fp32_contents"
    )


def _datatype(name: str) -> str:
    if not name:
        return "(empty)"
    return name if name.isascii() and name.isalnum() and len(name) <= 16 else shown(name)


def accepted_datatypes(model: ServedModel) -> list[str]:
    """Input datatypes a model takes: its own, and FP32 for a float16 model (cast here)."""
    return ["FP32"] if model.spec.dtype == np.float32 else ["FP16", "FP32"]


def decode_input(
    request: v2.ModelInferRequest, model: ServedModel, shared_memory: bool = False
) -> np.ndarray | RegionTensor:
    """The embeddings [n, seq, d] as sent: a view over raw bytes, or (shared_memory on) a
    reference to the client's shared-memory region."""
    tensor = _single_input(request, model)
    accepted = accepted_datatypes(model)
    if tensor.datatype not in accepted:
        raise InvalidInput(
            f"input '{INPUT_NAME}' has datatype {_datatype(tensor.datatype)};"
            f" {_model_ref(model)} expects {' or '.join(accepted)}"
        )
    d = model.spec.embed_dim
    if len(tensor.shape) != 3:
        raise InvalidInput(
            f"input '{INPUT_NAME}' has shape {shown_shape(list(tensor.shape))};"
            f" {_model_ref(model)} expects [n, seq, {d}]"
        )
    dtype = V2_DATATYPES[tensor.datatype]
    ref = shm_tensors.reference(tensor.parameters, f"input '{INPUT_NAME}'", shared_memory)
    if ref is not None:
        return _shared_input(request, tensor, dtype, ref)
    return _input_array(request, tensor, dtype)


def requested_outputs(request: v2.ModelInferRequest, model: ServedModel) -> list[str]:
    """Names asked for, in order, without repeats; none asked = 'output' alone."""
    names = list(dict.fromkeys(output.name for output in request.outputs)) or ["output"]
    for name in names:
        if name not in OUTPUT_NAMES:
            raise InvalidInput(
                f"unexpected inference output {shown(name)} for {_model_ref(model)};"
                f" outputs are {list(OUTPUT_NAMES)}"
            )
    return names


def output_refs(request: v2.ModelInferRequest, shared_memory: bool) -> dict[str, RegionRef]:
    """The requested outputs to be written into client shared memory, by name."""
    refs = {}
    for output in request.outputs:
        if not output.parameters:
            continue
        where = f"output {shown(output.name)}"
        ref = shm_tensors.reference(output.parameters, where, shared_memory)
        if ref is not None:
            refs[output.name] = ref
    return refs


def encode_response(
    request: v2.ModelInferRequest,
    model: ServedModel,
    names: list[str],
    result: Result,
    refs: dict[str, RegionRef] | None = None,
) -> WireMessage:
    """The ModelInferResponse, serialized with each output's bytes copied once into the
    message; one the worker wrote into the client's shared-memory region has none here. The
    fields come in field-number order (model, id, outputs, their bytes), as protobuf writes
    the whole message and as the Go gateway writes it."""
    arrays: list[np.ndarray] = []
    described: list[tuple[str, str, tuple[int, ...]]] = []
    for name in names:
        array = result.output if name == "output" else result.attention_weights
        assert array is not None, "weights were computed because they were requested"
        arrays.append(array)
        described.append((name, V2_NAME_OF[np.dtype(array.dtype)], array.shape))
    head, outputs = _header(model.spec.name, model.spec.version, tuple(described))
    response = WireMessage([head])
    if request.id:
        response.add_bytes(RESPONSE_ID, request.id.encode())
    response.add_serialized(_with_regions(outputs, refs) if refs else outputs)
    for name, array in zip(names, arrays, strict=True):
        in_region = refs is not None and name in refs
        # raw_output_contents pair with outputs by position: empty for one in a region.
        response.add_bytes(RAW_OUTPUT_CONTENTS, b"" if in_region else array_bytes(array))
    return response


@functools.lru_cache(maxsize=4096)
def _header(
    name: str, version: int, outputs: tuple[tuple[str, str, tuple[int, ...]], ...]
) -> tuple[bytes, bytes]:
    """The response's fields before its id (model name and version) and after it (the
    outputs' descriptions), serialized once per model, outputs and shapes."""
    head = v2.ModelInferResponse(model_name=name, model_version=str(version))
    described = v2.ModelInferResponse()
    for output, datatype, shape in outputs:
        described.outputs.add(name=output, datatype=datatype, shape=list(shape))
    return head.SerializeToString(), described.SerializeToString()


def _with_regions(outputs: bytes, refs: dict[str, RegionRef]) -> bytes:
    """The outputs' descriptions with each output that went into client shared memory naming
    its region in its parameters, in the order of their names (protobuf's deterministic
    order for a map, which the Go gateway writes too)."""
    message = v2.ModelInferResponse.FromString(outputs)
    for tensor in message.outputs:
        ref = refs.get(tensor.name)
        if ref is not None:
            for key, value in shm_tensors.response_parameters(ref).items():
                tensor.parameters[key].CopyFrom(value)
    return message.SerializeToString(deterministic=True)
