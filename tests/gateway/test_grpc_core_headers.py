"""What the generated differential test (test_differential_generated.py) found answered one
way with the gateway in front and another without it, each now answered as gRPC core answers
it on both paths (each test runs in both modes): the headers core parses into typed values,
header names gRPC does not allow, a missing te beside a refused header, several grpc-encoding
headers; and calls past their deadline on arrival. A message whose compressed-flag byte is
neither 0 nor 1, which core has no answer for, is refused by the gateway as grpc-go refuses
it. Raw HTTP/2, to a real server."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from service.client import attend_request
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2pb
from service.status_texts import (
    BAD_METADATA,
    DEADLINE_EXCEEDED,
    ILLEGAL_HEADER_KEY,
    UNEXPECTED_PAYLOAD_FORMAT,
)
from tests.harness.h2_raw import Headers, Message, Reply, exchange
from tests.harness.server_process import ServerProcess, behind_gateway

pytestmark = pytest.mark.usefixtures("grpc_gateway")

ATTEND = "/attention.v1.AttentionService/Attend"
ATTEND_STREAM = "/attention.v1.AttentionService/AttendStream"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"
OK, DEADLINE, UNIMPLEMENTED, INTERNAL = 0, 4, 12, 13


def attend(request_id: str = "", model: str = "") -> bytes:
    x = np.random.default_rng(3).standard_normal((3, 512), dtype=np.float32)
    return attend_request(x, model=model, request_id=request_id).SerializeToString()


def infer(request_id: str = "", model: str = "mha") -> bytes:
    x = np.random.default_rng(3).standard_normal((1, 3, 512), dtype=np.float32)
    request = v2pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="embeddings", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


# A call of each kind: the fast path's (plain, and one it hands to Python: an unknown model),
# a method Python always answers, and both streams.
UNARY = {
    MODEL_INFER: [infer(), infer(model="nope")],
    ATTEND: [attend(), attend(model="nope")],
    SERVER_LIVE: [b""],
}
STREAMS = {MODEL_STREAM_INFER: infer("a"), ATTEND_STREAM: attend("a")}


@pytest.fixture(scope="module")
def server(grpc_gateway: str, mha_repository: Path) -> Iterator[ServerProcess]:
    with ServerProcess(mha_repository) as process:
        assert behind_gateway(process) == (grpc_gateway == "on"), process.log
        yield process


def every_call(server: ServerProcess, headers: Headers) -> Iterator[tuple[str, Reply]]:
    """Each call of UNARY and STREAMS with these headers, and its reply."""
    for path, requests in UNARY.items():
        for request in requests:
            yield path, exchange(server.grpc_port, path, headers, [Message(request)])
    for path, request in STREAMS.items():
        yield path, exchange(server.grpc_port, path, headers, [Message(request)])


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("grpc-encoding", ["bogus"]),
        ("grpc-encoding", [""]),
        ("grpc-encoding", ["identity", "Identity"]),  # every value is parsed
        ("grpc-internal-encoding-request", ["x"]),
        ("grpc-status", ["-1"]),
        ("grpc-status", ["2147483647"]),
        ("grpc-previous-rpc-attempts", ["x"]),
        ("grpc-previous-rpc-attempts", ["4294967296"]),
        ("grpc-retry-pushback-ms", ["9223372036854775808"]),
        ("lb-cost-bin", ["YWJj"]),  # base64, shorter than the cost (a double) it holds
        ("grpclb_client_stats", ["x"]),  # core's own
    ],
)
def test_a_header_core_cannot_parse_is_internal_on_every_call(
    server: ServerProcess, name: str, values: list[str]
) -> None:
    """gRPC core parses these into typed values and refuses the call over a value it cannot
    read (the gateway used to serve the calls it answers, whatever the value)."""
    headers = Headers("trailers", tuple((name, value) for value in values))
    for path, reply in every_call(server, headers):
        assert (reply.code, reply.message) == (INTERNAL, BAD_METADATA.format(name=name)), path


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("grpc-status", " 3 "),
        ("grpc-previous-rpc-attempts", "+1"),
        ("grpc-retry-pushback-ms", "-5"),
        ("lb-cost-bin", base64.b64encode(b"12345678cost").decode()),
        ("grpc-internal-encoding-request", "gzip"),
    ],
)
def test_a_header_core_parses_is_taken_when_core_takes_it(
    server: ServerProcess, name: str, value: str
) -> None:
    for path, reply in every_call(server, Headers("trailers", ((name, value),))):
        assert reply.code == OK or "nope" in reply.message, (path, reply)


def test_of_several_grpc_encodings_the_last_counts(server: ServerProcess) -> None:
    """As gRPC core reads them (the gateway used to read the first, and served a call whose
    last encoding was gzip, which this server takes none of)."""
    declared = ("grpc-encoding", "identity"), ("grpc-encoding", "gzip")
    for path, reply in every_call(server, Headers("trailers", declared)):
        assert reply.code == UNIMPLEMENTED, (path, reply)
        assert reply.message == "Compression algorithm 'gzip' is disabled.", (path, reply)
    for path, reply in every_call(server, Headers("trailers", declared[::-1])):
        assert reply.code == OK or "nope" in reply.message, (path, reply)


@pytest.mark.parametrize("name", ["x~key", "x|key", "x%key", "x'key", "x~key-bin"])
def test_a_header_name_grpc_does_not_allow_is_internal(server: ServerProcess, name: str) -> None:
    """HTTP/2 allows any token character in a name, gRPC's metadata keys only 0-9 a-z _ - .
    (the gateway used to serve the calls it answers)."""
    for path, reply in every_call(server, Headers("trailers", ((name, "YWJj"),))):
        assert (reply.code, reply.message) == (INTERNAL, ILLEGAL_HEADER_KEY.format(name=name)), path


@pytest.mark.gateway_off_heavy
@pytest.mark.parametrize(
    ("header", "message"),
    [
        (("grpc-encoding", "bogus"), BAD_METADATA.format(name="grpc-encoding")),
        (("grpc-timeout", "1.5S"), BAD_METADATA.format(name="grpc-timeout")),
        (("x-key-bin", "YR"), "Error parsing 'x-key-bin' metadata: illegal base64 encoding"),
        (("x~key", "v"), ILLEGAL_HEADER_KEY.format(name="x~key")),
    ],
)
def test_a_refused_header_is_answered_before_a_missing_te(
    server: ServerProcess, header: tuple[str, str], message: str
) -> None:
    """Core resets a call without te only once its whole header block is parsed (the gateway
    used to reset it first)."""
    for path, reply in every_call(server, Headers(None, (header,))):
        assert (reply.code, reply.message) == (INTERNAL, message), path
    for path, reply in every_call(server, Headers(None)):
        assert reply.code == "reset", path


@pytest.mark.parametrize("timeout", ["0S", "0n", " 0m"])
def test_a_call_past_its_deadline_on_arrival_is_answered_so(
    server: ServerProcess, timeout: str
) -> None:
    """DEADLINE_EXCEEDED in gRPC core's words and no answer, whatever the messages (a
    unary call's two included: nothing reads them to find there are two). A timeout under a
    millisecond is one millisecond to core, and now to the gateway, which used to refuse
    "1n" at once; how such a call ends is up to timers on either path: the gateway's Go
    tests check how it reads the value."""
    headers = Headers("trailers", (("grpc-timeout", timeout),))
    for path, reply in every_call(server, headers):
        answered = (reply.code, reply.message, reply.messages())
        assert answered == (DEADLINE, DEADLINE_EXCEEDED, []), path
    two = [Message(infer()), Message(infer())]
    reply = exchange(server.grpc_port, MODEL_INFER, headers, two)
    assert (reply.code, reply.message) == (DEADLINE, DEADLINE_EXCEEDED), reply


def _failures(server: ServerProcess) -> tuple[int, float]:
    """mha's V2 statistics failures, and the calls counted DEADLINE_EXCEEDED."""
    with triton.InferenceServerClient(server.target) as client:
        stats = client.get_inference_statistics("mha").model_stats[0]
    counted = server.metric("attention_requests_total", code="DEADLINE_EXCEEDED")
    return stats.inference_stats.fail.count, counted


def test_a_call_past_its_deadline_on_arrival_is_not_counted(server: ServerProcess) -> None:
    """Core ends it before any handler runs, so neither V2 statistics nor the request metric
    sees it; the gateway, once it had read the message, passed it on to the worker, which
    counted a failure in the statistics."""
    before = _failures(server)
    headers = Headers("trailers", (("grpc-timeout", "0S"),))
    for _ in range(5):
        reply = exchange(server.grpc_port, MODEL_INFER, headers, [Message(infer())])
        assert (reply.code, reply.message) == (DEADLINE, DEADLINE_EXCEEDED), reply
    assert _failures(server) == before


def _served(path: str, answer: bytes) -> bool:
    """Whether a stream's answer is a message's result, not its error."""
    if path == ATTEND_STREAM:
        return pb.AttendStreamResponse.FromString(answer).HasField("response")
    return not v2pb.ModelStreamInferResponse.FromString(answer).error_message


def test_nothing_is_read_after_a_message_whose_flag_is_neither_0_nor_1(
    server: ServerProcess, grpc_gateway: str
) -> None:
    """gRPC defines no such flag. The gateway ends the call INTERNAL there, as grpc-go does (it
    used to hand the message to gRPC core and read no further). Core, without the gateway,
    reads nothing after it either but ends a stream OK, and answers a unary call as an empty
    request or as one without a message from call to call (docs/architecture.md, "Where it
    differs"): only what both do alike is checked there."""
    for flag in (2, 255):
        refused = (INTERNAL, UNEXPECTED_PAYLOAD_FORMAT.format(flag=flag))
        for path, request in STREAMS.items():
            sent = [Message(request), Message(request, flag=flag), Message(request)]
            # The gateway drops answers not yet written when it ends the call: lockstep there.
            lockstep = grpc_gateway == "on"
            reply = exchange(server.grpc_port, path, Headers("trailers"), sent, lockstep=lockstep)
            answers = reply.messages()
            served = [m for m in answers if _served(path, m)]
            assert len(served) == 1, (path, reply)  # the first message's; none after the flag
            if grpc_gateway == "on":
                assert (reply.code, reply.message, len(answers)) == (*refused, 1), (path, reply)
            else:  # core may answer the flagged message itself as an empty request
                assert reply.code == OK, (path, reply)
        for path, requests in UNARY.items():
            # A health call with such a flag goes to Python, as every call it does not read.
            if grpc_gateway == "on" and path != SERVER_LIVE:
                for later in ([], [Message(requests[0])]):
                    sent = [Message(requests[0], flag=flag), *later]
                    reply = exchange(server.grpc_port, path, Headers("trailers"), sent)
                    assert (reply.code, reply.message, reply.messages()) == (*refused, []), path
