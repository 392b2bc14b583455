"""The same generated calls to a server with the gRPC gateway in front (--grpc-gateway on) and
to one without it (off), both serving the same models: each call must end with the same status
code and message and carry the same answers (decoded; tensors equal to float tolerance),
whichever process answered it. Hypothesis writes the requests over the fast-path methods'
schemas (generated_requests.py) and their headers (generated_headers.py); streams mix
messages the gateway answers with messages it hands to Python. Raw HTTP/2, so bytes and
headers go out exactly as generated."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2pb
from tests.gateway.generated_headers import REFUSED_HEADERS, SPECIAL_HEADERS, call_headers
from tests.gateway.generated_requests import (
    MAX_BATCH,
    MAX_SEQ,
    attend_requests,
    infer_requests,
    messages,
)
from tests.harness.h2_raw import Headers, Message, Reply, exchange
from tests.harness.server_process import ServerProcess, behind_gateway

ATTEND = "/attention.v1.AttentionService/Attend"
ATTEND_STREAM = "/attention.v1.AttentionService/AttendStream"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
FLAGS = (
    *("--max-batch-size", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ)),
    # Region references reach the worker from the gateway as from Python.
    *("--client-shared-memory", "on"),
)
# The default run stays short (about 5 s a test on 2 cores); `pytest -m heavy` tries 20 times
# as many (a minute and a half a test).
EXAMPLES = [
    pytest.param(30, id="default"),
    pytest.param(600, id="heavy", marks=[pytest.mark.heavy, pytest.mark.timeout(1200)]),
]
V2_DTYPES = {"FP32": "<f4", "FP16": "<f2"}
ATTEND_DTYPES = {pb.DATA_TYPE_UNSPECIFIED: "<f4", pb.FLOAT32: "<f4", pb.FLOAT16: "<f2"}


@pytest.fixture(scope="module", autouse=True)
def hypothesis_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hypothesis' own files (a cache of the code's constants; no example database) in a
    temporary folder: the run leaves nothing in the repository."""
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)  # back to the default for the modules after this one


@pytest.fixture(scope="module")
def servers(mha_repository: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(gateway on, gateway off), started together."""
    started = [
        ServerProcess(mha_repository, *FLAGS, env={"ATTENTION_GRPC_GATEWAY": mode})
        for mode in ("on", "off")
    ]
    try:
        for server in started:
            server.wait_serving()
        assert [behind_gateway(server) for server in started] == [True, False]
        yield started[0], started[1]
    finally:
        for server in started:
            server.kill()


# -- answers, compared -----------------------------------------------------------------------

# An answer as compared: its message in text without tensor bytes or timings, and its
# tensors as (numpy dtype, bytes).
Tensors = list[tuple[str, bytes]]
Answer = tuple[str, Tensors]


def v2_answer(response: v2pb.ModelInferResponse) -> Tensors:
    types = [V2_DTYPES.get(output.datatype, "raw") for output in response.outputs]
    tensors = [
        (types[i] if i < len(types) else "raw", raw)
        for i, raw in enumerate(response.raw_output_contents)
    ]
    del response.raw_output_contents[:]
    return tensors


def attend_answer(response: pb.AttendResponse) -> Tensors:
    if response.HasField("timing"):  # the server's own times differ from call to call
        response.timing.queue_us = response.timing.compute_us = 0
        response.timing.SetInParent()
    tensors: Tensors = []
    for name in ("output", "attention_weights"):
        if response.HasField(name):  # touched only when there: presence is compared too
            tensor = getattr(response, name)
            tensors.append((ATTEND_DTYPES.get(tensor.dtype, "raw"), tensor.data))
            tensor.ClearField("data")
    return tensors


def v2_unary(data: bytes) -> tuple[ProtoMessage, Tensors]:
    response = v2pb.ModelInferResponse.FromString(data)
    return response, v2_answer(response)


def attend_unary(data: bytes) -> tuple[ProtoMessage, Tensors]:
    response = pb.AttendResponse.FromString(data)
    return response, attend_answer(response)


def v2_stream(data: bytes) -> tuple[ProtoMessage, Tensors]:
    response = v2pb.ModelStreamInferResponse.FromString(data)
    return response, v2_answer(response.infer_response)


def attend_stream(data: bytes) -> tuple[ProtoMessage, Tensors]:
    response = pb.AttendStreamResponse.FromString(data)
    # An error or an answer (a oneof): only the one there is touched.
    tensors = attend_answer(response.response) if response.HasField("response") else []
    return response, tensors


def decoded(path: str, data: bytes) -> Answer:
    try:
        message, tensors = DECODERS[path](data)
    except DecodeError:
        return f"not a message: {data!r}", []
    return text_format.MessageToString(message, as_utf8=True), tensors


def same_tensor(dtype: str, a: bytes, b: bytes) -> bool:
    """Equal bytes; or, where batching may add and order things differently, floats within
    1e-5 of each other (relative; absolute 1e-6 near zero, where relative means nothing)."""
    if a == b:
        return True
    if dtype == "raw" or len(a) != len(b):
        return False
    x, y = np.frombuffer(a, dtype), np.frombuffer(b, dtype)
    return bool(np.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True))


def assert_same(path: str, on: Reply, off: Reply, sent: list[Message], headers: Headers) -> None:
    what = f"{path} {headers} {sent}"
    assert (on.code, on.message) == (off.code, off.message), f"{what}\non: {on}\noff: {off}"
    answers_on = [decoded(path, m) for m in on.messages()]
    answers_off = [decoded(path, m) for m in off.messages()]
    assert [text for text, _ in answers_on] == [text for text, _ in answers_off], what
    for (_, tensors_on), (_, tensors_off) in zip(answers_on, answers_off, strict=True):
        assert [t for t, _ in tensors_on] == [t for t, _ in tensors_off], what
        for (dtype, a), (_, b) in zip(tensors_on, tensors_off, strict=True):
            assert same_tensor(dtype, a, b), what


def differ(
    servers: tuple[ServerProcess, ServerProcess],
    path: str,
    headers: Headers,
    sent: list[Message],
) -> None:
    # A stream's answers come in completion order: only sent one by one do its messages get
    # their answers in the same order on both paths.
    lockstep = path in (MODEL_STREAM_INFER, ATTEND_STREAM)
    on, off = (exchange(s.grpc_port, path, headers, sent, lockstep=lockstep) for s in servers)
    assert_same(path, on, off, sent, headers)


def run(examples: int, strategy: st.SearchStrategy[object], check: Callable[..., None]) -> None:
    """check(*drawn) over examples generated calls, the same ones on every run."""

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,  # nothing written into the repository
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=False,
    )
    @given(strategy)
    def generated(drawn: tuple[object, ...]) -> None:
        check(*drawn)

    generated()


DECODERS = {
    MODEL_INFER: v2_unary,
    ATTEND: attend_unary,
    MODEL_STREAM_INFER: v2_stream,
    ATTEND_STREAM: attend_stream,
}
UNARY = {MODEL_INFER: infer_requests, ATTEND: attend_requests}
STREAMS = {MODEL_STREAM_INFER: infer_requests, ATTEND_STREAM: attend_requests}


@pytest.mark.parametrize("examples", EXAMPLES)
@pytest.mark.parametrize("path", list(UNARY))
def test_a_unary_call_is_answered_alike_with_and_without_the_gateway(
    servers: tuple[ServerProcess, ServerProcess], path: str, examples: int
) -> None:
    calls = st.tuples(call_headers(), messages(UNARY[path]()))
    run(examples, calls, lambda headers, message: differ(servers, path, headers, [message]))


@pytest.mark.parametrize("examples", EXAMPLES)
@pytest.mark.parametrize("path", list(STREAMS))
def test_a_stream_is_answered_alike_with_and_without_the_gateway(
    servers: tuple[ServerProcess, ServerProcess], path: str, examples: int
) -> None:
    calls = st.tuples(call_headers(), st.lists(messages(STREAMS[path]()), min_size=1, max_size=5))
    run(examples, calls, lambda headers, sent: differ(servers, path, headers, sent))


# -- every listed header, and repeated fields, sent for certain ------------------------------
# Hypothesis draws a few of the listed headers per run; these are each sent once, on a plain
# call, so a gateway that served one of them (or refused one core takes) cannot pass by luck.


def _plain_infer(**fields: str) -> bytes:
    x = np.random.default_rng(3).standard_normal((1, 3, 512), dtype=np.float32)
    request = v2pb.ModelInferRequest(model_name="mha", **fields)
    request.inputs.add(name="embeddings", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def _plain_attend(**fields: str) -> bytes:
    x = np.random.default_rng(3).standard_normal((3, 512), dtype=np.float32)
    request = pb.AttendRequest(**fields)
    request.embeddings.shape.extend(x.shape)
    request.embeddings.data = x.tobytes()
    return request.SerializeToString()


@pytest.mark.parametrize(
    "header", [*SPECIAL_HEADERS, *REFUSED_HEADERS], ids=lambda h: f"{h[0]}={h[1]!r}"
)
def test_every_listed_header_is_answered_alike(
    servers: tuple[ServerProcess, ServerProcess], header: tuple[str, str]
) -> None:
    name, value = header
    headers = Headers(value, ()) if name == "te" else Headers("trailers", (header,))
    differ(servers, MODEL_INFER, headers, [Message(_plain_infer())])


# A scalar field given twice: protobuf keeps the last (the model's name and version decide
# which model answers; the id comes back in the answer).
REPEATED_FIELDS = {
    "v2 id": (
        MODEL_INFER,
        _plain_infer(id="first") + v2pb.ModelInferRequest(id="second").SerializeToString(),
    ),
    "v2 model name": (
        MODEL_INFER,
        v2pb.ModelInferRequest(model_name="nope").SerializeToString() + _plain_infer(),
    ),
    "v2 model name, last wrong": (
        MODEL_INFER,
        _plain_infer() + v2pb.ModelInferRequest(model_name="nope").SerializeToString(),
    ),
    "attend request id": (
        ATTEND,
        _plain_attend(request_id="first")
        + pb.AttendRequest(request_id="second").SerializeToString(),
    ),
}


@pytest.mark.parametrize("case", list(REPEATED_FIELDS))
def test_a_field_given_twice_is_read_as_protobuf_reads_it(
    servers: tuple[ServerProcess, ServerProcess], case: str
) -> None:
    path, body = REPEATED_FIELDS[case]
    differ(servers, path, Headers("trailers", ()), [Message(body)])
