"""Conversion between the wire Tensor message and numpy arrays (both directions)."""

from __future__ import annotations

import math

import numpy as np

from service.errors import InvalidInput
from service.generated.attention.v1 import attention_pb2 as pb
from service.text import shown_shape
from service.transport.wire import WireMessage, array_bytes

TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number

# An unset dtype (proto3 default) reads as FLOAT32, the common case.
NUMPY_BY_WIRE: dict[int, np.dtype] = {
    pb.DATA_TYPE_UNSPECIFIED: np.dtype("<f4"),
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
}
WIRE_BY_NUMPY: dict[np.dtype, pb.DataType] = {
    np.dtype("float32"): pb.FLOAT32,
    np.dtype("float16"): pb.FLOAT16,
}


def wire_dtype(dtype: np.dtype) -> pb.DataType:
    try:
        return WIRE_BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise InvalidInput(f"dtype {dtype} cannot be sent; expected float32 or float16") from None


MAX_NDIM = 4  # attention weights [n, h, seq, seq]; embeddings have 2 or 3


def checked_shape(shape: list[int], name: str) -> list[int]:
    """shape, once every dimension is known to be at least 1 (and there are few of them).

    With every dimension >= 1, a byte count that matches the product bounds each dimension
    by the bytes actually sent; a zero dimension next to huge ones ([0, 2**62, 2**62]) would
    otherwise pass that check and reach numpy's reshape.
    """
    if len(shape) > MAX_NDIM:
        raise InvalidInput(
            f"{name}.shape {shown_shape(shape)} has {len(shape)} dimensions; expected 2 or 3"
        )
    if any(dim < 0 for dim in shape):
        raise InvalidInput(f"{name}.shape {shown_shape(shape)} has a negative dimension")
    if 0 in shape:
        raise InvalidInput(
            f"{name} is empty (shape {shown_shape(shape)}); every dimension must be at least 1"
        )
    return shape


def tensor_layout(tensor: pb.Tensor, name: str) -> tuple[list[int], np.dtype]:
    """The declared shape and dtype, checked (the bytes may be elsewhere)."""
    if tensor.dtype not in NUMPY_BY_WIRE:
        received = (
            pb.DataType.Name(tensor.dtype) if tensor.dtype in pb.DataType.values() else tensor.dtype
        )
        raise InvalidInput(f"{name}.dtype is {received}; expected FLOAT32 or FLOAT16")
    return checked_shape(list(tensor.shape), name), NUMPY_BY_WIRE[tensor.dtype]


def decode_tensor(tensor: pb.Tensor, name: str) -> np.ndarray:
    """A read-only view over the message's bytes (no copy), shaped as declared."""
    shape, dtype = tensor_layout(tensor, name)
    expected_bytes = math.prod(shape) * dtype.itemsize
    if len(tensor.data) != expected_bytes:
        raise InvalidInput(
            f"{name}.data has {len(tensor.data)} bytes; shape {shape} of "
            f"{'FLOAT16' if dtype.itemsize == 2 else 'FLOAT32'} needs {expected_bytes} bytes "
            "(little-endian, row-major)"
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)


def encode_tensor(array: np.ndarray, dtype: np.dtype | None = None) -> pb.Tensor:
    """Little-endian, row-major bytes in dtype (default: the array's own)."""
    target = np.dtype(dtype or array.dtype).newbyteorder("<")
    return pb.Tensor(
        shape=list(array.shape),
        dtype=wire_dtype(target),
        data=np.ascontiguousarray(array, dtype=target).tobytes(),
    )


def encode_tensor_wire(array: np.ndarray, dtype: np.dtype | None = None) -> WireMessage:
    """encode_tensor's message, already serialized, with the bytes copied once."""
    target = np.dtype(dtype or array.dtype).newbyteorder("<")
    header = pb.Tensor(shape=list(array.shape), dtype=wire_dtype(target))
    return WireMessage.of(header).add_bytes(
        TENSOR_DATA, array_bytes(array.astype(target, copy=False))
    )
