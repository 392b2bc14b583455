"""Write service/gateway/api_gen.go: the names of the served APIs that the gateway's Go reads
and writes on the calls it answers itself, taken from the Python that serves them.

- the paths of the gRPC methods it answers, from the services' descriptors (the generated
  protobuf modules in service/generated/);
- V2's tensor names and the attention weights' dtype (service/frontend/v2_codec.py), the
  dtypes a model is served in by their numpy and V2 names (v2_codec.V2_DATATYPES), and the
  V2 datatype of each attention.v1 DataType (service/transport/codec.py's NUMPY_BY_WIRE);
- the tensor parameters that name a client's region (service/frontend/shm_tensors.py) and
  those Python tolerates (v2_codec.TOLERATED_INPUT_PARAMETERS, _OUTPUT_PARAMETERS), the
  AttendRequest fields that name one (service/frontend/attention_servicer.py's
  REGION_FIELDS), and the longest region name (service/dataplane.py).

scripts/go_contract.py writes it with the other generated Go (make proto) and checks it.
"""

from __future__ import annotations

import json

import numpy as np
from grpc_health.v1 import health_pb2

from scripts.go_wire_contract import comment_lines, const_block, go_name
from service import catalog
from service.dataplane import MAX_REGION_NAME_CHARS
from service.frontend import attention_servicer, shm_tensors, v2_codec
from service.frontend import server as frontend_server
from service.generated.attention.v1 import attention_pb2
from service.generated.inference import grpc_service_pb2
from service.transport import codec

SOURCES = (
    "the protobuf modules in service/generated/ and grpc_health, service/catalog.py, "
    "service/frontend/server.py, v2_codec.py, "
    "shm_tensors.py and attention_servicer.py, service/transport/codec.py and "
    "service/dataplane.py"
)
# The methods the gateway answers (when a call is plain), by their Go names: (the protobuf
# module's descriptor, service, method).
METHODS = {
    "modelInferPath": (grpc_service_pb2.DESCRIPTOR, "GRPCInferenceService", "ModelInfer"),
    "modelStreamInferPath": (
        grpc_service_pb2.DESCRIPTOR,
        "GRPCInferenceService",
        "ModelStreamInfer",
    ),
    "attendPath": (attention_pb2.DESCRIPTOR, "AttentionService", "Attend"),
    "attendStreamPath": (attention_pb2.DESCRIPTOR, "AttentionService", "AttendStream"),
    "serverLivePath": (grpc_service_pb2.DESCRIPTOR, "GRPCInferenceService", "ServerLive"),
    "serverReadyPath": (grpc_service_pb2.DESCRIPTOR, "GRPCInferenceService", "ServerReady"),
    "modelReadyPath": (grpc_service_pb2.DESCRIPTOR, "GRPCInferenceService", "ModelReady"),
    "healthCheckPath": (health_pb2.DESCRIPTOR, "Health", "Check"),
}


def method_paths() -> dict[str, str]:
    """Each method's path as gRPC sends it: /package.Service/Method."""
    paths = {}
    for name, (file, service, method) in METHODS.items():
        descriptor = file.services_by_name[service]
        paths[name] = f"/{descriptor.full_name}/{descriptor.methods_by_name[method].name}"
    return paths


def service_names() -> list[str]:
    """The full names of every service of the protobuf files the gateway reads."""
    files = (grpc_service_pb2.DESCRIPTOR, attention_pb2.DESCRIPTOR)
    return [service.full_name for file in files for service in file.services_by_name.values()]


def tensor_names() -> dict[str, str]:
    return {
        "inputName": v2_codec.INPUT_NAME,
        "outputName": v2_codec.OUTPUT_NAME,
        "weightsName": v2_codec.WEIGHTS_NAME,
    }


def served_dtypes() -> dict[str, tuple[str, str, int]]:
    """Each dtype a model is served in, by numpy's name (as the worker reports a model's):
    (V2's name, numpy's little-endian code, bytes a value)."""
    dtypes = {}
    for v2_name, dtype in v2_codec.V2_DATATYPES.items():
        assert v2_codec.V2_NAME_OF[dtype] == v2_name, f"{v2_name}: V2_NAME_OF names it otherwise"
        dtypes[dtype.name] = (v2_name, dtype.str, dtype.itemsize)
    return dtypes


def data_type_constant(number: int) -> str:
    """proto_gen.go's name of an attention.v1 DataType value: dataTypeFloat32."""
    value = attention_pb2.DataType.Name(number).removeprefix("DATA_TYPE_")
    return go_name(value, "dataType")


def attention_datatypes() -> dict[str, list[str]]:
    """The DataType values the front end reads, grouped by the V2 datatype each is read as."""
    grouped: dict[str, list[str]] = {}
    for number, dtype in codec.NUMPY_BY_WIRE.items():
        grouped.setdefault(v2_codec.V2_NAME_OF[np.dtype(dtype)], []).append(
            data_type_constant(number)
        )
    return grouped


def region_fields() -> dict[str, str]:
    """AttendRequest's region fields by their proto_gen.go constants."""
    fields = attention_pb2.AttendRequest.DESCRIPTOR.fields_by_name
    for name in attention_servicer.REGION_FIELDS:
        assert name in fields, f"REGION_FIELDS names {name}, not a field of AttendRequest"
    return {go_name(name, "fieldAttendRequest"): name for name in attention_servicer.REGION_FIELDS}


def parameters() -> dict[str, str]:
    return {
        "paramRegion": shm_tensors.REGION,
        "paramOffset": shm_tensors.OFFSET,
        "paramByteSize": shm_tensors.BYTE_SIZE,
    }


def _string_set(name: str, words: frozenset[str], comment: str) -> list[str]:
    entries = ", ".join(f"{json.dumps(word)}: true" for word in sorted(words))
    return [*comment_lines(comment), f"var {name} = map[string]bool{{{entries}}}", ""]


def _dtypes() -> list[str]:
    dtypes = {json.dumps(name) + ":": values for name, values in served_dtypes().items()}
    width = max(map(len, dtypes))
    return [
        "// dtypeInfo is a dtype a model is served in: V2's name, numpy's, bytes a value.",
        "type dtypeInfo struct {",
        "\tv2, numpy string",
        "\tsize      int64",
        "}",
        "",
        "// dtypes are the dtypes a model is served in, by numpy's name (the worker reports a",
        "// model's so): v2_codec.V2_DATATYPES.",
        "var dtypes = map[string]dtypeInfo{",
        *(
            f"\t{key:<{width}} {{v2: {json.dumps(v2)}, numpy: {json.dumps(code)}, size: {size}}},"
            for key, (v2, code, size) in dtypes.items()
        ),
        "}",
        "",
    ]


def _attention_datatype() -> list[str]:
    cases = [
        line
        for v2_name, constants in attention_datatypes().items()
        for line in (f"\tcase {', '.join(constants)}:", f"\t\treturn {json.dumps(v2_name)}")
    ]
    return [
        "// attentionDatatype is the V2 datatype an attention.v1 DataType is read as, as the",
        '// front end reads it (transport/codec.py\'s NUMPY_BY_WIRE); "" for any other.',
        "func attentionDatatype(dtype uint64) string {",
        "\tswitch dtype {",
        *cases,
        "\t}",
        '\treturn ""',
        "}",
        "",
    ]


def _region_fields() -> list[str]:
    entries = {key + ":": json.dumps(name) for key, name in region_fields().items()}
    width = max(map(len, entries))
    return [
        "// regionFields name AttendRequest's region fields, as the worker's errors name them",
        "// (attention_servicer.REGION_FIELDS).",
        "var regionFields = map[int]string{",
        *(f"\t{key:<{width}} {value}," for key, value in entries.items()),
        "}",
        "",
    ]


def render() -> str:
    weights = v2_codec.WEIGHTS_DTYPE
    lines = [
        f"// Code generated by scripts/go_api_contract.py from {SOURCES}; DO NOT EDIT.",
        "",
        "package main",
        "",
        *const_block(
            method_paths(), "The gRPC methods answered here (their services' descriptors)."
        ),
        *const_block(tensor_names(), "V2's tensor names (v2_codec.py)."),
        *_string_set(
            "healthServiceNames",
            frozenset(["", *frontend_server.SERVICE_NAMES]),
            "The health service's entries besides one per model: the server's and each API's\n"
            "(frontend/server.py's SERVICE_NAMES).",
        ),
        *const_block(
            {
                "healthServing": health_pb2.HealthCheckResponse.SERVING,
                "healthNotServing": health_pb2.HealthCheckResponse.NOT_SERVING,
            },
            "grpc.health.v1's statuses.",
        ),
        *const_block(
            {"serverLabel": catalog.SERVER_LABEL, "unknownModelLabel": catalog.UNKNOWN_LABEL},
            "The model label of a call's metrics when it names no model, or no served one\n"
            "(catalog.py).",
        ),
        *const_block(
            {"weightsDatatype": v2_codec.V2_NAME_OF[weights], "weightsNumpy": weights.str},
            "The attention weights' dtype, whatever the model's (v2_codec.WEIGHTS_DTYPE).",
        ),
        *_dtypes(),
        *_attention_datatype(),
        *const_block(
            parameters(), "The V2 tensor parameters that name a client's region (shm_tensors.py)."
        ),
        *_string_set(
            "toleratedInputParams",
            v2_codec.TOLERATED_INPUT_PARAMETERS,
            "Parameters the Python front end accepts and ignores on an input and on a requested\n"
            "output (v2_codec.TOLERATED_INPUT_PARAMETERS, _OUTPUT_PARAMETERS); any other\n"
            "makes a call not plain.",
        ),
        *_string_set(
            "toleratedOutputParams",
            v2_codec.TOLERATED_OUTPUT_PARAMETERS,
            "toleratedOutputParams: see toleratedInputParams.",
        ),
        *_region_fields(),
        "// maxRegionNameChars is the longest region name a client may register",
        "// (dataplane.MAX_REGION_NAME_CHARS).",
        f"const maxRegionNameChars = {MAX_REGION_NAME_CHARS}",
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
