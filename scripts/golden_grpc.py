"""Write tests/golden/grpc/: the gRPC frames of the calls the Go gateway answers itself and
the trailers of every refusal, as the Python front end writes them. Both test suites read
them (tests/gateway/test_golden_frames.py, service/gateway/golden_test.go): a client must
not be able to tell which of the two answered.

- <case>.frame: a gRPC length-prefixed message (flag byte, 4-byte big-endian length, then
  the message serialized by the Python protobuf classes: fields in number order, a map's
  entries in key order), described in frames.json: its message type, its fields by their
  protobuf names (tensor bytes as float32 values, enum values by name), and for an answer
  the request it answers (and for an error the refusal it carries);
- trailers.json: each refusal's grpc-status and grpc-message as they appear on the wire
  (percent-encoded as gRPC core encodes it), which side writes it, and what it was made of.

    python -m scripts.golden_grpc            # rewrite the files (make golden)
    python -m scripts.golden_grpc --check    # exit 1 when a file differs from what this writes
"""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from scripts import golden_files
from service import status_texts
from service.catalog import BatchCaps, ModelSpec, ModelView
from service.errors import QueueFull, ServingError, ShuttingDown
from service.frontend import handlers, v2_codec
from service.frontend.delivery import AnswerBudget
from service.frontend.restricted import Key, Restrictions
from service.frontend.rpc import internal_error
from service.frontend.status import code_for
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2
from service.ipc import messages
from service.ipc.slab import RegionAllocator
from service.ipc.status_page import QueueFill

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "grpc"
FRAMES_JSON, TRAILERS_JSON = "frames.json", "trailers.json"
NUMBERS = re.compile(r"\[\s+(-?[\d.]+(?:,\s+-?[\d.]+)*)\s+\]")
MESSAGES: dict[str, type[Message]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (
        v2.ModelInferRequest,
        v2.ModelInferResponse,
        v2.ModelStreamInferResponse,
        pb.AttendRequest,
        pb.AttendResponse,
        pb.AttendStreamResponse,
    )
}
# The model every frame is for (frames.json has it too).
MODEL = {"name": "mha", "version": 1, "embed_dim": 4, "num_heads": 2, "dtype": "float32"}


def served_model() -> ModelView:
    """MODEL as a front end sees it."""
    spec = ModelSpec("mha", 1, 4, 2, False, np.dtype("float32"), "", "")
    return ModelView("mha/1", spec, "CPUExecutionProvider", BatchCaps(((16, 8),)), True)


def values(count: int, first: int = 0) -> list[float]:
    """count float32 values that JSON writes exactly (eighths)."""
    return [(first + i) / 8 - 1 for i in range(count)]


def float32_bytes(numbers: list[float]) -> bytes:
    return np.asarray(numbers, dtype="<f4").tobytes()


def _input(shape: list[int], **extra: Any) -> dict[str, Any]:
    return {"name": "embeddings", "datatype": "FP32", "shape": shape, **extra}


def _output(shape: list[int], name: str = "output", **extra: Any) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": shape, **extra}


def _region(name: str, byte_size: int, offset: int | None = None) -> dict[str, Any]:
    refs: dict[str, Any] = {"shared_memory_region": {"string_param": name}}
    if offset is not None:
        refs["shared_memory_offset"] = {"int64_param": offset}
    return {**refs, "shared_memory_byte_size": {"int64_param": byte_size}}


V2 = "inference.ModelInferRequest"
ATTEND = "attention.v1.AttendRequest"
V2_MODEL = {"model_name": "mha", "model_version": "1"}
ATTEND_MODEL = {"model": "mha", "model_version": "1"}
QUEUE_FULL = "queue-full-by-count"
ODD_ID = "a\nb 'c' \\d\u00a0e\u200bé🙂" + "x" * 60

REQUESTS: dict[str, dict[str, Any]] = {
    "v2-infer-request": {
        "message": V2,
        "fields": {
            **V2_MODEL,
            "id": "req-7",
            "inputs": [_input([1, 2, 4])],
            "raw_input_contents": [values(8)],
        },
    },
    # A request id shown escaped and cut short in an error message.
    "v2-infer-request-odd-id": {
        "message": V2,
        "fields": {
            **V2_MODEL,
            "id": ODD_ID,
            "inputs": [_input([1, 2, 4])],
            "raw_input_contents": [values(8)],
        },
    },
    "v2-infer-request-weights": {
        "message": V2,
        "fields": {
            "model_name": "mha",
            "inputs": [_input([2, 2, 4], parameters={"binary_data_size": {"int64_param": 64}})],
            "outputs": [
                {"name": "output", "parameters": {"binary_data": {"bool_param": True}}},
                {"name": "attention_weights"},
            ],
            "raw_input_contents": [values(16, 3)],
        },
    },
    "v2-infer-request-region": {
        "message": V2,
        "fields": {
            "id": "shm-1",
            "inputs": [_input([1, 2, 4], parameters=_region("client-in", 32, offset=64))],
            "outputs": [{"name": "output", "parameters": _region("client-out", 32)}],
        },
    },
    "attend-request": {
        "message": ATTEND,
        "fields": {
            "embeddings": {"shape": [2, 4], "dtype": "FLOAT32", "data": values(8, 1)},
            "request_id": "a-1",
        },
    },
    "attend-request-weights": {
        "message": ATTEND,
        "fields": {
            **ATTEND_MODEL,
            "embeddings": {"shape": [2, 2, 4], "data": values(16, 2)},
            "return_attention_weights": True,
        },
    },
    # Requests the gateway hands to the Python front end, which refuses them.
    "v2-request-bad-shape": {
        "message": V2,
        "fields": {"inputs": [_input([1, 8])], "raw_input_contents": [values(8)]},
    },
    "v2-request-bad-datatype": {
        "message": V2,
        "fields": {
            "inputs": [{**_input([1, 2, 4]), "datatype": "FP64"}],
            "raw_input_contents": [values(16)],
        },
    },
    "v2-request-bad-name": {
        "message": V2,
        "fields": {
            "inputs": [{**_input([1, 2, 4]), "name": "tökens 50%"}],
            "raw_input_contents": [values(8)],
        },
    },
}


def answers(refusals: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every answer's description; refusals (trailers.json's) give the stream errors' words."""
    full = refusals[QUEUE_FULL]
    full_text, full_code = unquoted(full["grpc-message"]), int(full["grpc-status"])
    v2_answer = {
        **V2_MODEL,
        "id": "req-7",
        "outputs": [_output([1, 2, 4])],
        "raw_output_contents": [values(8, 40)],
    }
    attend_answer = {
        "output": {"shape": [2, 4], "dtype": "FLOAT32", "data": values(8, 40)},
        **ATTEND_MODEL,
        "request_id": "a-1",
        "timing": {"queue_us": 123, "compute_us": 456, "batch_size": 3},
    }
    weights = {"shape": [2, 2, 2, 2], "dtype": "FLOAT32", "data": values(16, 60)}
    region_output = _output([1, 2, 4], parameters=_region("client-out", 32, offset=0))
    v2_response, attend_response = "inference.ModelInferResponse", "attention.v1.AttendResponse"
    v2_stream, attend_stream = (
        "inference.ModelStreamInferResponse",
        "attention.v1.AttendStreamResponse",
    )
    return {
        "v2-infer-response": _answer(v2_response, "v2-infer-request", v2_answer),
        "v2-infer-response-weights": _answer(
            v2_response,
            "v2-infer-request-weights",
            {
                **V2_MODEL,
                "outputs": [_output([2, 2, 4]), _output([2, 2, 2, 2], "attention_weights")],
                "raw_output_contents": [values(16, 40), values(16, 60)],
            },
        ),
        "v2-infer-response-region": _answer(
            v2_response,
            "v2-infer-request-region",
            {**V2_MODEL, "id": "shm-1", "outputs": [region_output], "raw_output_contents": [[]]},
        ),
        "attend-response": _answer(attend_response, "attend-request", attend_answer),
        "attend-response-weights": _answer(
            attend_response,
            "attend-request-weights",
            {
                "output": {"shape": [2, 2, 4], "dtype": "FLOAT32", "data": values(16, 40)},
                "attention_weights": weights,
                **ATTEND_MODEL,
                "timing": {"compute_us": 789, "batch_size": 2},  # queue_us 0: left out
            },
        ),
        "v2-stream-response": _answer(v2_stream, "v2-infer-request", {"infer_response": v2_answer}),
        "v2-stream-error": _answer(
            v2_stream,
            "v2-infer-request-weights",
            {"error_message": full_text, "infer_response": {"model_name": "mha"}},
            QUEUE_FULL,
        ),
        "attend-stream-response": _answer(
            attend_stream, "attend-request", {"request_id": "a-1", "response": attend_answer}
        ),
        "attend-stream-error": _answer(
            attend_stream,
            "attend-request",
            {"request_id": "a-1", "error": {"code": full_code, "message": full_text}},
            QUEUE_FULL,
        ),
    }


def _answer(
    message: str, request: str, fields: dict[str, Any], refusal: str | None = None
) -> dict[str, Any]:
    described: dict[str, Any] = {"message": message, "answers": request}
    if refusal is not None:
        described["refusal"] = refusal
    return {**described, "fields": fields}


def build(message: str, fields: Mapping[str, Any]) -> Message:
    """The message of type message (a full name) that fields describe."""
    built = MESSAGES[message]()
    _fill(built, fields)
    return built


def _fill(message: Message, fields: Mapping[str, Any]) -> None:
    message.SetInParent()  # a message field described as {} is set, and empty
    for name, value in fields.items():
        described = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name)
        if described.message_type is not None and described.message_type.GetOptions().map_entry:
            for key, entry in value.items():
                _fill(target[key], entry)
        elif described.message_type is not None:
            for item in value if described.is_repeated else [value]:
                _fill(target.add() if described.is_repeated else target, item)
        elif described.is_repeated:
            target.extend(_scalar(described, item) for item in value)
        else:
            setattr(message, name, _scalar(described, value))


def _scalar(described: FieldDescriptor, value: Any) -> Any:
    if described.type == FieldDescriptor.TYPE_BYTES:
        return float32_bytes(value)  # every bytes field here holds a tensor's values
    if described.enum_type is not None:
        return described.enum_type.values_by_name[value].number
    return value


def frame(message: Message) -> bytes:
    """The message as a gRPC length-prefixed message, uncompressed."""
    body = message.SerializeToString(deterministic=True)
    return struct.pack(">BI", 0, len(body)) + body


def grpc_message(text: str) -> str:
    """text as gRPC core writes it in grpc-message: its UTF-8 bytes, each one outside
    printable ASCII (and '%') as %XX."""
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
        for byte in text.encode()
    )


def unquoted(wire: str) -> str:
    """A grpc-message as written on the wire, decoded."""
    out, i = bytearray(), 0
    while i < len(wire):
        if wire[i] == "%":
            out.append(int(wire[i + 1 : i + 3], 16))
            i += 3
        else:
            out += wire[i].encode()
            i += 1
    return out.decode()


# -- refusals ------------------------------------------------------------------------------

Status = tuple[grpc.StatusCode, str]


@dataclass(frozen=True)
class Case:
    """A refusal: who writes it ("both": the gateway for the calls it answers, Python for the
    others; "gateway": the gateway alone, in gRPC core's words where core writes them on
    Python's own port; "python": the gateway hands such calls to Python), how the Python
    front end comes to it, what it is made of, and the request of the call refused."""

    by: str
    words: Callable[[Case], Status]
    args: dict[str, Any] = field(default_factory=dict)
    request: str | None = "v2-infer-request"


def _error(error: ServingError) -> Status:
    return code_for(error), str(error)


def _raised(call: Callable[[], object]) -> Status:
    try:
        call()
    except ServingError as error:
        return _error(error)
    raise AssertionError("not refused")


def _queue_full(case: Case) -> Status:
    a = case.args
    fill = QueueFill(a["pending"], a["pending_bytes"], a["max_queue_size"], a["max_queue_bytes"])
    return _error(QueueFull(fill.refusal(a["nbytes"]) or ""))


def _backlogged(case: Case) -> Status:
    a = case.args
    budget = AnswerBudget(a["max_bytes"], a["max_bytes_per_connection"])
    budget.reserve(a["holder"], a["held"])
    return _raised(lambda: budget.reserve(a["peer"], a["nbytes"]))


def _slab(case: Case) -> Status:
    allocator = RegionAllocator(case.args["size"])
    for nbytes in case.args["held"]:
        allocator.alloc(nbytes)
    return _raised(lambda: [allocator.alloc(nbytes) for nbytes in case.args["nbytes"]])


def _shutting_down(case: Case) -> Status:
    return _error(ShuttingDown(getattr(status_texts, case.args["text"])))


def _from_worker(case: Case) -> Status:
    error = messages.rebuild_error(case.args["kind"], case.args["message"])
    assert isinstance(error, ServingError), "a kind the front end maps to a status"
    return _error(error)


def _unexpected(case: Case) -> Status:
    """An error of the worker's that no status maps: the front end's answer to an unexpected
    error, which names the request id (and logs what went wrong)."""
    error = messages.rebuild_error(case.args["kind"], case.args["message"])
    assert not isinstance(error, ServingError), "an error the front end maps to a status"
    described = REQUESTS[case.request or ""]
    request = build(described["message"], described["fields"])
    assert isinstance(request, v2.ModelInferRequest)
    return grpc.StatusCode.INTERNAL, internal_error(request.id)[1]


def _denied(case: Case) -> Status:
    a = case.args
    restrictions = Restrictions({a["group"]: Key(a["header"], "the-key")})
    headers = {} if a["sent"] is None else {a["header"]: a["sent"]}
    return _raised(lambda: restrictions.check(a["group"], headers))


def _invalid(case: Case) -> Status:
    described = REQUESTS[case.request or ""]
    request = build(described["message"], described["fields"])
    assert isinstance(request, v2.ModelInferRequest)
    return _raised(lambda: v2_codec.decode_input(request, served_model()))


def _words(code: grpc.StatusCode, name: str) -> Callable[[Case], Status]:
    """Words of status_texts (gRPC core's where core writes them itself), formatted."""
    return lambda case: (code, getattr(status_texts, name).format(**case.args))


def _handlers(name: str) -> Callable[[Case], Status]:
    return lambda case: (grpc.StatusCode.INTERNAL, getattr(handlers, name))


INTERNAL, UNAVAILABLE = grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE
PERMISSION = {"group": "inference", "header": "x-admin-key"}
PEER = "192.0.2.1:1234"  # the address a Go test request comes from (httptest's)
REFUSALS: dict[str, Case] = {
    QUEUE_FULL: Case(
        "both",
        _queue_full,
        {"pending": 64, "pending_bytes": 2048, "max_queue_size": 64, "max_queue_bytes": 1 << 20}
        | {"nbytes": 32},
    ),
    "queue-full-by-bytes": Case(
        "both",
        _queue_full,
        {"pending": 5, "pending_bytes": 1000, "max_queue_size": 64, "max_queue_bytes": 1024}
        | {"nbytes": 32},
    ),
    "answers-backlogged-by-server": Case(
        "both",
        _backlogged,
        {"max_bytes": 64, "max_bytes_per_connection": 64, "holder": "192.0.2.9:1234"}
        | {"held": 40, "peer": PEER, "nbytes": 32},
    ),
    "answers-backlogged-by-connection": Case(
        "both",
        _backlogged,
        {"max_bytes": 1024, "max_bytes_per_connection": 64, "holder": PEER}
        | {"held": 40, "peer": PEER, "nbytes": 32},
    ),
    "slab-too-small": Case("both", _slab, {"size": 32, "held": [], "nbytes": [32, 32]}),
    "slab-full": Case("both", _slab, {"size": 160, "held": [64], "nbytes": [32, 32]}),
    "not-accepting": Case("both", _shutting_down, {"text": "NOT_ACCEPTING"}),
    "worker-restarting": Case("both", _shutting_down, {"text": "WORKER_RESTARTING"}),
    # Errors the worker sends, relayed (kind and words) by either side.
    "worker-gone": Case(
        "both", _from_worker, {"kind": "ShuttingDown", "message": status_texts.WORKER_GONE}
    ),
    "region-not-found": Case(
        "both",
        _from_worker,
        {"kind": "RegionNotFound", "message": "shared-memory region 'réglon 50%' was unregistered"},
        "v2-infer-request-region",
    ),
    "worker-internal": Case(
        "both", _unexpected, {"kind": "Internal", "message": "the worker failed this request"}
    ),
    "worker-internal-odd-id": Case(
        "both",
        _unexpected,
        {"kind": "Internal", "message": "the worker failed this request"},
        "v2-infer-request-odd-id",
    ),
    "deadline-exceeded": Case(
        "both", _words(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
    ),
    "stream-closed": Case("both", _words(UNAVAILABLE, "STREAM_CLOSED"), request=None),
    "permission-denied-without-key": Case("both", _denied, {**PERMISSION, "sent": None}),
    "permission-denied-wrong-key": Case("both", _denied, {**PERMISSION, "sent": "guess"}),
    "metadata-too-large": Case(
        "gateway",
        _words(grpc.StatusCode.RESOURCE_EXHAUSTED, "METADATA_TOO_LARGE"),
        {"size": 9000, "limit": 8192},
    ),
    "bad-binary-header": Case(
        "gateway", _words(INTERNAL, "BAD_BINARY_HEADER"), {"name": "x-trace-bin"}
    ),
    "bad-metadata": Case(
        "gateway", _words(INTERNAL, "BAD_METADATA"), {"name": "grpc-previous-rpc-attempts"}
    ),
    "illegal-header-key": Case("gateway", _words(INTERNAL, "ILLEGAL_HEADER_KEY"), {"name": "x~a"}),
    "bad-te": Case("gateway", _words(INTERNAL, "BAD_TE"), {"value": ""}),
    "bad-timeout": Case("gateway", _words(INTERNAL, "BAD_TIMEOUT"), {"value": "1x"}),
    "backend-gone": Case("gateway", _words(UNAVAILABLE, "BACKEND_GONE")),
    "stream-ended-without-status": Case(
        "gateway", _words(INTERNAL, "STREAM_ENDED_WITHOUT_STATUS"), request=None
    ),
    "no-request": Case("python", _handlers("NO_REQUEST"), {"body": []}, None),
    "more-than-one-request": Case(
        "python",
        _handlers("MORE_THAN_ONE_REQUEST"),
        {"body": ["v2-infer-request", "v2-infer-request"]},
        None,
    ),
    "invalid-shape": Case("python", _invalid, request="v2-request-bad-shape"),
    "invalid-datatype": Case("python", _invalid, request="v2-request-bad-datatype"),
    "invalid-name": Case("python", _invalid, request="v2-request-bad-name"),
}


def trailers() -> dict[str, dict[str, Any]]:
    """trailers.json: each refusal as a client reads it, with what it was made of."""
    written = {}
    for name, case in REFUSALS.items():
        code, text = case.words(case)
        written[name] = {
            "by": case.by,
            "code": code.name,
            "grpc-status": str(code.value[0]),
            "grpc-message": grpc_message(text),
            "args": case.args,
        }
        if case.request is not None:
            written[name]["request"] = case.request
    return written


def render() -> dict[str, bytes]:
    """Every file of tests/golden/grpc/, by name."""
    refused = trailers()
    described = {**REQUESTS, **answers(refused)}
    files = {
        f"{name}.frame": frame(build(d["message"], d["fields"])) for name, d in described.items()
    }
    index = {"model": MODEL, "frames": described}
    files[FRAMES_JSON] = _json(index)
    files[TRAILERS_JSON] = _json(refused)
    return files


def _json(value: object) -> bytes:
    """value as JSON, a list of numbers on one line."""
    text = json.dumps(value, indent=1, ensure_ascii=False)
    text = NUMBERS.sub(lambda m: "[" + re.sub(r",\s+", ", ", m[1]) + "]", text)
    return (text + "\n").encode()


def main(argv: list[str] | None = None) -> int:
    return golden_files.main(
        argv,
        description=__doc__.splitlines()[0],
        default_out=GOLDEN,
        render=render,
        module="scripts.golden_grpc",
    )


if __name__ == "__main__":
    sys.exit(main())
