"""V2 tensors that live in client shared memory: the shared_memory_region / _offset / _byte_size
parameters of an input or requested output, checked against the region before any byte is
read or written."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from service.errors import InvalidInput
from service.frontend.client_memory import ClientRegion, ClientRegions
from service.generated.inference import grpc_service_pb2 as v2
from service.text import shown

REGION, OFFSET = "shared_memory_region", "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
PARAMETERS = frozenset({REGION, OFFSET, BYTE_SIZE})
OFF = (
    "client shared memory is off on this server (start it with --client-shared-memory on, "
    "for clients on the same host); send the tensor's bytes instead"
)


@dataclass(frozen=True)
class TensorRef:
    """byte_size bytes at offset inside a registered region (bounds checked)."""

    region: ClientRegion
    offset: int
    byte_size: int

    def parameters(self) -> dict[str, v2.InferParameter]:
        """The reference as a response's output parameters (as Triton answers them)."""
        return {
            REGION: v2.InferParameter(string_param=self.region.name),
            OFFSET: v2.InferParameter(int64_param=self.offset),
            BYTE_SIZE: v2.InferParameter(int64_param=self.byte_size),
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
    parameters: Mapping[str, v2.InferParameter], where: str, regions: ClientRegions | None
) -> TensorRef | None:
    """The tensor's shared-memory reference, if its parameters name one; RegionNotFound for an
    unknown region, InvalidInput for a reference outside it."""
    if not PARAMETERS.intersection(parameters):
        return None
    if regions is None:
        raise InvalidInput(f"{where} has parameter {REGION}: {OFF}")
    if REGION not in parameters or parameters[REGION].WhichOneof("parameter_choice") != (
        "string_param"
    ):
        raise InvalidInput(f"{where} has shared-memory parameters without {REGION} (a string)")
    byte_size = _count(parameters, BYTE_SIZE, where)
    if byte_size is None:
        raise InvalidInput(f"{where} names a shared-memory region without {BYTE_SIZE}")
    offset = _count(parameters, OFFSET, where) or 0
    return region_ref(parameters[REGION].string_param, offset, byte_size, where, regions)


def region_ref(
    name: str, offset: int, byte_size: int, where: str, regions: ClientRegions | None
) -> TensorRef:
    """A reference to a registered region, checked against its bounds."""
    if regions is None:
        raise InvalidInput(f"{where}: {OFF}")
    region = regions.get(name)
    if offset + byte_size > region.byte_size:
        raise InvalidInput(
            f"{where}: {OFFSET} {offset} + {BYTE_SIZE} {byte_size} is past the end of "
            f"shared-memory region {shown(region.name)} ({region.byte_size} bytes)"
        )
    return TensorRef(region, offset, byte_size)


def read_input(ref: TensorRef, shape: list[int], dtype: np.dtype, where: str) -> np.ndarray:
    """A view of the input in the client's region (copied into the slab before any await)."""
    need = math.prod(shape) * dtype.itemsize
    if ref.byte_size != need:
        raise InvalidInput(
            f"{where} has {BYTE_SIZE} {ref.byte_size}; shape {shape} of "
            f"{np.dtype(dtype).name} needs {need} bytes"
        )
    ref.region.check_alive()
    return np.frombuffer(ref.region.view(ref.offset, need), dtype=dtype).reshape(shape)


def check_room(ref: TensorRef, nbytes: int, name: str) -> None:
    """Before compute: the answer fits where the client asked for it."""
    if nbytes > ref.byte_size:
        raise InvalidInput(
            f"output {shown(name)} needs {nbytes} bytes; its {BYTE_SIZE} is {ref.byte_size}"
        )


def write_output(ref: TensorRef, array: np.ndarray) -> None:
    """Copy the answer into the client's region; RegionNotFound if it went while computing."""
    check_room(ref, array.nbytes, "answer")
    ref.region.check_alive()
    target = np.frombuffer(ref.region.view(ref.offset, array.nbytes), dtype=array.dtype)
    np.copyto(target.reshape(array.shape), array)
