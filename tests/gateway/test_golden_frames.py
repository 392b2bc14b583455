"""The golden gRPC frames and trailers of tests/golden/grpc/ (scripts/golden_grpc.py writes
them): the Python protobuf classes read and write each frame byte for byte, the Python front
end writes each answer and each refusal as they are there, and gRPC core puts each refusal on
the wire in those words. The Go gateway's tests (service/gateway/golden_test.go) read the same
files with the gateway's own parser and encoders: a client cannot tell which side answered."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message

from scripts import golden_grpc
from service.dataplane import Result
from service.frontend import attention_servicer, v2_codec, v2_servicer
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2
from service.transport.wire import WireMessage
from tests.harness.h2_raw import RawGrpc

GOLDEN = golden_grpc.GOLDEN
INDEX = json.loads((GOLDEN / golden_grpc.FRAMES_JSON).read_text())
FRAMES: dict[str, dict[str, Any]] = INDEX["frames"]
TRAILERS: dict[str, dict[str, Any]] = json.loads((GOLDEN / golden_grpc.TRAILERS_JSON).read_text())
ANSWERS = [name for name, described in FRAMES.items() if "answers" in described]


def _body(name: str) -> bytes:
    """The frame's message, once its 5-byte prefix is checked."""
    framed = (GOLDEN / f"{name}.frame").read_bytes()
    flag, length = struct.unpack_from(">BI", framed)
    assert (flag, length) == (0, len(framed) - 5), name
    return framed[5:]


def _parsed(name: str) -> Message:
    return golden_grpc.MESSAGES[FRAMES[name]["message"]].FromString(_body(name))


def test_the_golden_files_are_what_the_generator_writes() -> None:
    assert golden_grpc.main(["--check"]) == 0, "run python -m scripts.golden_grpc (make golden)"


def test_the_model_is_the_one_the_frames_are_for() -> None:
    spec = golden_grpc.served_model().spec
    model = INDEX["model"]
    assert (spec.name, spec.version, spec.embed_dim, spec.num_heads) == (
        model["name"],
        model["version"],
        model["embed_dim"],
        model["num_heads"],
    )
    assert str(spec.dtype) == model["dtype"]


@pytest.mark.parametrize("name", FRAMES)
def test_each_frame_reads_and_writes_back_byte_for_byte(name: str) -> None:
    """Parsed and serialized again (a map's entries in key order, as every frame has them),
    and built from its description in frames.json: the same bytes."""
    body = _body(name)
    parsed = _parsed(name)
    assert parsed.SerializeToString(deterministic=True) == body
    built = golden_grpc.build(FRAMES[name]["message"], FRAMES[name]["fields"])
    assert built == parsed
    assert built.SerializeToString(deterministic=True) == body


def _array(tensor: dict[str, Any], shape: list[int]) -> np.ndarray:
    return np.asarray(tensor, dtype="<f4").reshape(shape) if tensor else np.zeros(shape, "<f4")


def _v2_result(fields: dict[str, Any]) -> Result:
    """The worker's result the answer was encoded from."""
    arrays = {
        output["name"]: _array(raw, output["shape"])
        for output, raw in zip(fields["outputs"], fields["raw_output_contents"], strict=True)
    }
    return Result(arrays["output"], arrays.get("attention_weights"), 0.0, 0.0, 1)


def _attend_result(fields: dict[str, Any]) -> Result:
    def batched(tensor: dict[str, Any], rank: int) -> np.ndarray:
        shape = tensor["shape"] if len(tensor["shape"]) == rank else [1, *tensor["shape"]]
        return _array(tensor["data"], shape)

    weights = fields.get("attention_weights")
    timing = fields["timing"]
    return Result(
        batched(fields["output"], 3),
        None if weights is None else batched(weights, 4),
        timing.get("queue_us", 0) / 1e6,
        timing.get("compute_us", 0) / 1e6,
        timing["batch_size"],
    )


def _v2_answer(request: v2.ModelInferRequest, fields: dict[str, Any]) -> WireMessage:
    model = golden_grpc.served_model()
    names = v2_codec.requested_outputs(request, model)
    refs = v2_codec.output_refs(request, shared_memory=True)
    return v2_codec.encode_response(request, model, names, _v2_result(fields), refs)


def _attend_answer(request: pb.AttendRequest, fields: dict[str, Any]) -> WireMessage:
    refs = {name: None for name in attention_servicer.REGION_FIELDS}
    model = golden_grpc.served_model()
    return attention_servicer.encode_response(request, model, _attend_result(fields), dict(refs))


def _refusal(name: str) -> tuple[grpc.StatusCode, str]:
    golden = TRAILERS[name]
    return grpc.StatusCode[golden["code"]], golden_grpc.unquoted(golden["grpc-message"])


def _front_end_answer(name: str) -> bytes:
    """The answer's message as the Python front end writes it, from the request it answers
    and the worker's result (or refusal)."""
    described = FRAMES[name]
    request: Any = _parsed(described["answers"])
    fields = described["fields"]
    message = described["message"]
    if message == "inference.ModelInferResponse":
        return _v2_answer(request, fields).serialize()
    if message == "attention.v1.AttendResponse":
        return _attend_answer(request, fields).serialize()
    if "refusal" in described:
        failure = (
            v2_servicer.stream_error
            if message == "inference.ModelStreamInferResponse"
            else attention_servicer.stream_error
        )
        return failure(request, *_refusal(described["refusal"])).SerializeToString()
    if message == "inference.ModelStreamInferResponse":
        return v2_servicer.stream_answer(_v2_answer(request, fields["infer_response"])).serialize()
    answer = _attend_answer(request, fields["response"])
    return attention_servicer.stream_answer(request, answer).serialize()


@pytest.mark.parametrize("name", ANSWERS)
def test_the_python_front_end_writes_each_answer_byte_for_byte(name: str) -> None:
    assert _front_end_answer(name) == _body(name)


@pytest.mark.parametrize("name", TRAILERS)
def test_the_python_front_end_words_each_refusal_as_golden(name: str) -> None:
    """Each refusal as the Python front end comes to it (its errors through the one status
    table, its texts, gRPC core's words), percent-encoded as gRPC core encodes grpc-message."""
    golden = TRAILERS[name]
    case = golden_grpc.REFUSALS[name]
    code, text = case.words(case)
    assert (code.name, str(code.value[0])) == (golden["code"], golden["grpc-status"])
    assert golden_grpc.grpc_message(text) == golden["grpc-message"]
    assert golden_grpc.unquoted(golden["grpc-message"]) == text
    assert (golden["by"], golden["args"], golden.get("request")) == (
        case.by,
        case.args,
        case.request,
    )


class _Refusing(grpc.GenericRpcHandler):
    """Ends /golden.Refusals/<name> with that refusal's code and words."""

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        code, text = _refusal(handler_call_details.method.rsplit("/", 1)[1])

        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.abort(code, text)
            raise AssertionError("abort returned")

        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture(scope="module")
def refusing_port() -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((_Refusing(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


@pytest.mark.parametrize("name", TRAILERS)
def test_grpc_core_puts_each_refusal_on_the_wire_as_golden(name: str, refusing_port: int) -> None:
    """The Python front end's server (gRPC core) writes grpc-status and grpc-message exactly
    as trailers.json has them (and as the gateway writes them)."""
    client = RawGrpc(refusing_port)
    try:
        state = client.wait(client.call(f"/golden.Refusals/{name}", b""))
    finally:
        client.close()
    golden = TRAILERS[name]
    assert state.headers.get("grpc-status") == golden["grpc-status"], state
    assert state.headers.get("grpc-message") == golden["grpc-message"], state
