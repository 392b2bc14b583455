"""Tensors that live in client shared memory: the shared_memory_region / _offset / _byte_size
parameters of a V2 input or requested output (and the Attention API's region fields), read
into references that the worker, which holds the regions, checks before any byte moves."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from service.dataplane import MAX_REGION_NAME_CHARS, RegionRef, RegionTensor, region_not_found
from service.errors import InvalidInput
from service.generated.inference import grpc_service_pb2 as v2

REGION, OFFSET = "shared_memory_region", "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
PARAMETERS = frozenset({REGION, OFFSET, BYTE_SIZE})
OFF = (
    "client shared memory is off on this server (start it with --client-shared-memory on, "
    "for clients on the same host); send the tensor's bytes instead"
)


def response_parameters(ref: RegionRef) -> dict[str, v2.InferParameter]:
    """A reference as a response's output parameters (as Triton answers them)."""
    return {
        REGION: v2.InferParameter(string_param=ref.region),
        OFFSET: v2.InferParameter(int64_param=ref.offset),
        BYTE_SIZE: v2.InferParameter(int64_param=ref.byte_size),
    }


def _count(parameters: Mapping[str, v2.InferParameter], name: str, where: str) -> int | None:
    if name not in parameters:
        return None
    parameter = parameters[name]
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param") or getattr(parameter, kind) < 0:
        raise InvalidInput(f"{where} parameter {name} must be a byte count (an integer >= 0)")
    return int(getattr(parameter, kind))


def reference(
    parameters: Mapping[str, v2.InferParameter], where: str, enabled: bool
) -> RegionRef | None:
    """The tensor's shared-memory reference, if its parameters name one. Whether the region
    exists and holds it, the worker checks (it holds the regions) before any byte moves."""
    if not PARAMETERS.intersection(parameters):
        return None
    if not enabled:
        raise InvalidInput(f"{where} has parameter {REGION}: {OFF}")  # before its form
    if REGION not in parameters or parameters[REGION].WhichOneof("parameter_choice") != (
        "string_param"
    ):
        raise InvalidInput(f"{where} has shared-memory parameters without {REGION} (a string)")
    byte_size = _count(parameters, BYTE_SIZE, where)
    if byte_size is None:
        raise InvalidInput(f"{where} names a shared-memory region without {BYTE_SIZE}")
    offset = _count(parameters, OFFSET, where) or 0
    return region_ref(parameters[REGION].string_param, offset, byte_size, where, enabled)


def region_ref(name: str, offset: int, byte_size: int, where: str, enabled: bool) -> RegionRef:
    if not enabled:
        raise InvalidInput(f"{where}: {OFF}")
    if len(name) > MAX_REGION_NAME_CHARS:  # registration refuses it: no region has this name
        raise region_not_found(name)
    return RegionRef(name, offset, byte_size, where)


def input_tensor(ref: RegionRef, shape: list[int], dtype: np.dtype) -> RegionTensor:
    """The input in the client's region: [n, seq, d] of dtype (its byte size, the worker
    checks once it has found the region)."""
    n, seq, d = shape
    return RegionTensor(ref, (n, seq, d), np.dtype(dtype))
