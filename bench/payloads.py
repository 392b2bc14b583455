"""Request messages serialized once before a run, and a protobuf wire walker that reads the few
response fields the load generator needs without parsing (copying) the tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import numpy as np

from bench.stats import Lengths
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2

# v2_rest: the same V2 inference over HTTP/REST (Triton's binary tensor extension); v2_shm:
# V2 ModelInfer over gRPC with the input and the output in client shared memory (Triton's
# system shared-memory extension).
APIS = ("attention", "v2", "attention_stream", "v2_stream", "v2_rest", "v2_shm")
REST = "v2_rest"
SHM = "v2_shm"
METHODS = {
    "attention": "/attention.v1.AttentionService/Attend",
    "v2": "/inference.GRPCInferenceService/ModelInfer",
    SHM: "/inference.GRPCInferenceService/ModelInfer",
    "attention_stream": "/attention.v1.AttentionService/AttendStream",
    "v2_stream": "/inference.GRPCInferenceService/ModelStreamInfer",
}
# Tag bytes of the request-id fields (field number << 3 | length-delimited), appended to a
# pre-serialized request: protobuf lets a field come after the others, so no re-encoding.
ID_TAG = {"attention": b"\x2a", "v2": b"\x1a"}  # AttendRequest.request_id=5, ModelInferRequest.id=3


def family(api: str) -> str:
    """'attention' or 'v2': the message family an API speaks."""
    return "v2" if api == SHM else api.removesuffix("_stream")


@dataclass(frozen=True)
class Payload:
    body: bytes
    sequences: int
    length: int
    weights: bool
    header_bytes: int = 0  # REST: the JSON header's length (Inference-Header-Content-Length)

    @classmethod
    def of(cls, body: bytes) -> Payload:
        """A gRPC request's bytes, for callers that count nothing else."""
        return cls(body, 1, 0, False)


def attend_body(x: np.ndarray, weights: bool, model: str) -> bytes:
    shape = list(x.shape if x.shape[0] > 1 else x.shape[1:])  # one sequence goes as [seq, d]
    return pb.AttendRequest(
        model=model,
        embeddings=pb.Tensor(shape=shape, dtype=pb.FLOAT32, data=x.tobytes()),
        return_attention_weights=weights,
    ).SerializeToString()


def v2_body(x: np.ndarray, weights: bool, model: str) -> bytes:
    request = v2.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
    request.inputs.add(name="embeddings", datatype="FP32", shape=list(x.shape))
    if weights:  # none listed = output only; listing both asks for the weights graph
        request.outputs.add(name="output")
        request.outputs.add(name="attention_weights")
    return request.SerializeToString()


def rest_body(x: np.ndarray, weights: bool) -> tuple[bytes, int]:
    """A V2 REST request with Triton's binary tensor extension: the JSON header, then the
    tensor's bytes; outputs come back binary too. Returns (body, header length)."""
    outputs = ["output", "attention_weights"] if weights else ["output"]
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "embeddings",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs],
        }
    ).encode()
    return header + x.tobytes(), len(header)


def shm_body(shape: list[int], model: str, region: str, output_offset: int) -> bytes:
    """A V2 request whose input is bytes [0, n) of region and whose output goes to bytes
    [output_offset, output_offset + n): a message of a few hundred bytes."""
    nbytes = 4 * int(np.prod(shape))

    def refer(parameters: object, offset: int) -> None:
        parameters["shared_memory_region"].string_param = region  # type: ignore[index]
        parameters["shared_memory_offset"].int64_param = offset  # type: ignore[index]
        parameters["shared_memory_byte_size"].int64_param = nbytes  # type: ignore[index]

    request = v2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=shape)
    refer(tensor.parameters, 0)
    refer(request.outputs.add(name="output").parameters, output_offset)
    return request.SerializeToString()


def build_payloads(
    api: str,
    lengths: Lengths,
    *,
    embed_dim: int,
    sequences: int,
    weights_fraction: float,
    model: str,
    seed: int = 0,
) -> dict[tuple[int, bool], Payload]:
    """One serialized request per (length, wants weights) the run can draw."""
    rng = np.random.default_rng(seed)
    encode = attend_body if family(api) == "attention" else v2_body
    flags = [
        flag for flag, used in ((False, weights_fraction < 1), (True, weights_fraction > 0)) if used
    ]
    payloads = {}
    for length in lengths.values():
        x = rng.standard_normal((sequences, length, embed_dim), dtype=np.float32)
        for flag in flags:
            if api == SHM:  # the tensor's bytes, which the caller puts in its region
                payloads[length, flag] = Payload(x.tobytes(), sequences, length, flag)
            elif api == REST:
                body, header = rest_body(x, flag)
                payloads[length, flag] = Payload(body, sequences, length, flag, header)
            else:
                payloads[length, flag] = Payload(encode(x, flag, model), sequences, length, flag)
    return payloads


def with_id(body: bytes, api: str, request_id: bytes) -> bytes:
    """body with its request-id field set (ids up to 127 bytes)."""
    return body + ID_TAG[family(api)] + bytes((len(request_id),)) + request_id


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(buf: bytes | memoryview) -> dict[int, memoryview | int]:
    """Top-level fields of a serialized message: number -> value (a view for length-delimited
    fields, the integer for varints; the last occurrence wins). Skips fixed32/64."""
    view = memoryview(buf)
    found: dict[int, memoryview | int] = {}
    pos = 0
    while pos < len(view):
        key, pos = _varint(view, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            found[number], pos = _varint(view, pos)
        elif wire == 2:
            size, pos = _varint(view, pos)
            found[number] = view[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return found


def _view(found: dict[int, memoryview | int], number: int) -> memoryview | None:
    value = found.get(number)
    return value if isinstance(value, memoryview) else None


def _int(found: dict[int, memoryview | int], number: int) -> int:
    value = found.get(number, 0)
    return value if isinstance(value, int) else 0


@dataclass(frozen=True)
class Timing:
    queue_us: int
    compute_us: int
    batch_size: int


def attend_timing(response: bytes | memoryview) -> Timing | None:
    """AttendResponse.timing (field 6) without touching the output tensor."""
    timing = _view(fields(response), 6)
    if timing is None:
        return None
    values = fields(timing)
    return Timing(_int(values, 1), _int(values, 2), _int(values, 3))


@dataclass(frozen=True)
class StreamReply:
    request_id: str
    code: str  # "OK" or a status code name
    timing: Timing | None


def attend_stream_reply(message: bytes) -> StreamReply:
    """AttendStreamResponse: request_id=1, response=2, error=3 {code=1, message=2}."""
    top = fields(message)
    request_id = bytes(_view(top, 1) or b"").decode()
    error = _view(top, 3)
    if error is not None:
        return StreamReply(request_id, code_name(_int(fields(error), 1)), None)
    response = _view(top, 2)
    return StreamReply(request_id, "OK", attend_timing(response) if response else None)


def v2_stream_reply(message: bytes) -> StreamReply:
    """ModelStreamInferResponse: error_message=1, infer_response=2 {id=3}."""
    top = fields(message)
    response = _view(top, 2)
    request_id = bytes(_view(fields(response), 3) or b"").decode() if response else ""
    failed = len(_view(top, 1) or b"") > 0
    return StreamReply(request_id, "STREAM_ERROR" if failed else "OK", None)


CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def code_name(number: int) -> str:
    """The name of a gRPC status code number (UNKNOWN=2 when it has none)."""
    return CODE_NAMES.get(number, f"CODE_{number}")
