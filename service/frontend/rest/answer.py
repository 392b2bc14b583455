"""An infer answer as KServe V2 REST writes it: JSON, or JSON followed by binary tensors
(Triton's binary tensor extension), in chunks of bytes of its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from service.dataplane import RegionRef, Result
from service.frontend import shm_tensors
from service.frontend.rest import pieces
from service.frontend.rest.codec import InferBody
from service.transport.wire import array_bytes

# The answer goes out in chunks of about this size: bounded copies, and bounded writes.
CHUNK_BYTES = 1 << 20


class _Chunks:
    """Bytes gathered into chunks of about CHUNK_BYTES: few writes, and none unbounded."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.nbytes = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def add(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        self.nbytes += len(data)
        if self._pending_bytes >= CHUNK_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.chunks.append(b"".join(self._pending))
            self._pending, self._pending_bytes = [], 0


def _compact(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def encode_infer(
    body: InferBody,
    model_name: str,
    version: int,
    names: list[str],
    result: Result,
    refs: dict[str, RegionRef] | None = None,
) -> tuple[list[bytes], int | None]:
    """The answer's body in chunks of about CHUNK_BYTES, and its JSON's length when binary
    tensors follow it. Everything is copied out of result (which may live in shared memory),
    so result can be released once this returns. Outputs asked for in client shared memory
    (written there by the worker) carry no data. A large JSON answer takes seconds, in
    bounded pieces (service/frontend/rest/pieces.py): call it off the event loop."""
    arrays = {"output": result.output, "attention_weights": result.attention_weights}
    head: dict[str, Any] = {"model_name": model_name, "model_version": str(version)}
    if body.request.id:
        head["id"] = body.request.id
    text = _Chunks()
    text.add(_compact(head)[:-1] + b',"outputs":[')
    binary: list[memoryview] = []
    for index, name in enumerate(names):
        array = arrays[name]
        assert array is not None, "weights were computed because they were requested"
        datatype = "FP16" if array.dtype == np.float16 else "FP32"
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        text.add(b"," if index else b"")
        ref = (refs or {}).get(name)
        if ref is not None:
            entry["parameters"] = {
                shm_tensors.REGION: ref.region,
                shm_tensors.OFFSET: ref.offset,
                shm_tensors.BYTE_SIZE: ref.byte_size,
            }
            text.add(_compact(entry))
        elif body.binary_outputs.get(name, body.binary_default):
            data = array_bytes(array)
            entry["parameters"] = {"binary_data_size": len(data)}
            binary.append(data)
            text.add(_compact(entry))
        else:
            text.add(_compact(entry)[:-1] + b',"data":[')
            for piece in pieces.encode_values(array):
                text.add(piece)
            text.add(b"]}")
    text.add(b"]}")
    text.flush()
    header_length = text.nbytes
    for data in binary:
        text.chunks.extend(_copied(data))
    return text.chunks, header_length if binary else None


def _copied(data: memoryview) -> Iterator[bytes]:
    """data as bytes of our own, a chunk at a time (each copy short)."""
    for start in range(0, len(data), CHUNK_BYTES):
        yield bytes(data[start : start + CHUNK_BYTES])
