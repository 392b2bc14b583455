"""AttendStream and V2 ModelStreamInfer over real gRPC: answers, errors, shared batches,
back-pressure, cancellation, shutdown; tritonclient's stream API unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench.harness import wait_for
from service.client import AsyncAttentionClient, AttendError, AttendResult, AttentionClient
from service.errors import InvalidInput
from service.frontend.handlers import add_servicer
from service.frontend.streaming import StreamCalls, serve_stream
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.settings import Settings
from service.status_texts import DEADLINE_EXCEEDED
from service.transport.wire import WireMessage
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import REPO_ROOT, ServerProcess

D, H = 64, 4  # the "small" model (newest version 2, seed 7) keeps these tests quick
TIMEOUT_S = 60
# Requests wait in the queue until --max-batch-size sequences are there (no measured caps).
PARKED = ("--max-queue-delay-ms", "60000", "--max-batch-size", "64", "--batch-cap-budget-s", "0")


@pytest.fixture(scope="module")
def reference():
    return layer_for(D, H, seed=7)


@pytest.fixture(scope="module")
def small_only(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with only small/2: servers of their own start quicker."""
    root = tmp_path_factory.mktemp("small-only")
    shutil.copytree(model_repository / "small" / "2", root / "small" / "2")
    return root


@pytest.fixture(scope="module")
def parked(small_only: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    """Requests wait in the queue until 64 sequences are there."""
    with ServerProcess(small_only, *PARKED) as process:
        yield process
    assert process.process.returncode == 0, process.log


def _x(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal((*shape, D), dtype=np.float32)


def _request(x: np.ndarray, request_id: str = "", **fields) -> pb.AttendRequest:
    tensor = pb.Tensor(shape=list(x.shape), dtype=pb.FLOAT32, data=x.tobytes())
    return pb.AttendRequest(model="small", embeddings=tensor, request_id=request_id, **fields)


def _v2_request(x: np.ndarray, request_id: str, model: str = "small"):
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="embeddings", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def _input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


class HeldOpen:
    """Requests for a blocking stream that is not half-closed until close() is called."""

    def __init__(self, requests: Iterable[object]) -> None:
        self._requests = list(requests)
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[object]:
        yield from self._requests
        self._closed.wait(TIMEOUT_S)

    def close(self) -> None:
        self._closed.set()


def _queue_empty(server: ServerProcess) -> None:
    wait_for(lambda: server.metric("attention_queue_depth_requests") == 0, what="an empty queue")


# -- AttendStream ---------------------------------------------------------------------------


def test_many_requests_on_one_stream_are_answered_by_id(
    client: AttentionClient, server: ServerProcess, reference
) -> None:
    rng = np.random.default_rng(0)
    inputs = {
        f"r{i}": _x(rng, 1 + i % 3, 2 + i % 11) if i % 4 == 0 else _x(rng, 2 + i % 13)
        for i in range(60)
    }
    wants_weights = {rid: i % 5 == 0 for i, rid in enumerate(inputs)}
    ok_before = server.metric(
        "attention_requests_total", model="small", api="attention_stream", code="OK"
    )
    timed_before = server.metric(
        "attention_request_duration_seconds_count", model="small", api="attention_stream"
    )
    answers = list(
        client.attend_stream(
            [
                (x, {"request_id": rid, "return_attention_weights": wants_weights[rid]})
                for rid, x in inputs.items()
            ],
            model="small",
            timeout_s=TIMEOUT_S,
        )
    )
    assert sorted(answer.request_id for answer in answers) == sorted(inputs)
    for answer in answers:
        assert isinstance(answer, AttendResult), answer
        x = inputs[answer.request_id]
        want_output, want_weights = attend_alone(reference, x)
        assert (answer.model, answer.model_version) == ("small", "2")
        np.testing.assert_allclose(answer.output, want_output, atol=1e-5, rtol=0)
        if wants_weights[answer.request_id]:
            assert answer.attention_weights is not None
            np.testing.assert_allclose(answer.attention_weights, want_weights, atol=1e-6, rtol=0)
        else:
            assert answer.attention_weights is None
    labels = {"model": "small", "api": "attention_stream"}
    assert server.metric("attention_requests_total", code="OK", **labels) == ok_before + 60
    assert server.metric("attention_request_duration_seconds_count", **labels) == timed_before + 60


def test_a_stream_without_weights_never_runs_the_weights_graph(
    client: AttentionClient, server: ServerProcess
) -> None:
    graph = {"model": "small", "graph": "output+attention_weights"}
    before = server.metric("attention_batches_total", **graph)
    xs = [np.ones((3, D), np.float32)] * 10
    answers = list(client.attend_stream(xs, model="small", timeout_s=TIMEOUT_S))
    assert all(a.attention_weights is None for a in answers if isinstance(a, AttendResult))
    assert len(answers) == 10
    assert server.metric("attention_batches_total", **graph) == before


def test_async_client_streams_an_async_iterable_and_names_answers_by_position(
    server: ServerProcess, client: AttentionClient
) -> None:
    rng = np.random.default_rng(1)
    xs = [_x(rng, 3 + i) for i in range(12)]

    async def session() -> list[AttendResult | AttendError]:
        async def requests() -> AsyncIterator[np.ndarray]:
            for x in xs:
                yield x

        async with AsyncAttentionClient(server.target) as attention:
            stream = attention.attend_stream(requests(), model="small", timeout_s=TIMEOUT_S)
            return [answer async for answer in stream]

    answers = asyncio.run(session())
    assert sorted(int(a.request_id) for a in answers) == list(range(12))
    for answer in answers:
        assert isinstance(answer, AttendResult), answer
        unary = client.attend(xs[int(answer.request_id)], model="small").output
        np.testing.assert_allclose(answer.output, unary, atol=1e-5, rtol=0)


def test_an_array_the_client_cannot_send_ends_the_stream_after_the_answers_before_it(
    server: ServerProcess, client: AttentionClient
) -> None:
    """The sent requests are answered, then InvalidInput is raised, as attend() raises it;
    likewise an error of the caller's own iterable. gRPC used to end the whole call: the
    blocking client raised UNKNOWN "Exception iterating requests!", the asyncio client a
    CancelledError, and the answers to the valid requests were lost."""
    good = np.ones((3, D), np.float32)
    items: list[np.ndarray] = [good, good, good.astype(np.float64)]
    answers: list[AttendResult | AttendError] = []

    def collect(stream: Iterable[AttendResult | AttendError]) -> None:
        answers.extend(stream)  # what came before the error stays in answers

    with pytest.raises(InvalidInput, match="float64"):
        collect(client.attend_stream(items, model="small", timeout_s=TIMEOUT_S))
    assert sorted(a.request_id for a in answers if isinstance(a, AttendResult)) == ["0", "1"]

    def failing() -> Iterator[np.ndarray]:
        yield good
        raise LookupError("the caller's own")

    answers.clear()
    with pytest.raises(LookupError, match="the caller's own"):
        collect(client.attend_stream(failing(), model="small", timeout_s=TIMEOUT_S))
    assert [a.request_id for a in answers] == ["0"]

    async def session(
        requests: Iterable[np.ndarray] | AsyncIterator[np.ndarray],
    ) -> list[AttendResult | AttendError]:
        seen: list[AttendResult | AttendError] = []

        async def collect_async(stream: AsyncIterator[AttendResult | AttendError]) -> None:
            async for answer in stream:
                seen.append(answer)

        async with AsyncAttentionClient(server.target) as attention:
            stream = attention.attend_stream(requests, model="small", timeout_s=TIMEOUT_S)
            with pytest.raises(InvalidInput, match="float64"):
                await collect_async(stream)
        return seen

    async def async_items() -> AsyncIterator[np.ndarray]:
        for item in items:
            yield item

    for requests in (items, async_items()):
        seen = asyncio.run(session(requests))
        assert sorted(a.request_id for a in seen if isinstance(a, AttendResult)) == ["0", "1"]


BAD_IN_THE_MIDDLE = {
    "bad-d": (
        _request(np.ones((3, 32), np.float32)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "model 'small' expects d=64",
    ),
    "bad-model": (
        pb.AttendRequest(model="nope", embeddings=_request(np.ones((3, D), np.float32)).embeddings),
        grpc.StatusCode.NOT_FOUND,
        "unknown model 'nope'",
    ),
    "bad-bytes": (
        pb.AttendRequest(
            model="small", embeddings=pb.Tensor(shape=[2, D], dtype=pb.FLOAT32, data=b"\0" * 10)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "has 10 bytes; shape [2, 64] of FLOAT32 needs 512 bytes",
    ),
    "bad-nan": (
        _request(np.full((2, D), np.nan, np.float32)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "non-finite",
    ),
}


def test_a_bad_message_gets_its_error_and_the_stream_goes_on(
    server: ServerProcess, reference
) -> None:
    rng = np.random.default_rng(2)
    good = {f"good-{i}": _x(rng, 4 + i) for i in range(len(BAD_IN_THE_MIDDLE) + 1)}
    requests = []
    for (good_id, x), bad_id in zip(good.items(), [*BAD_IN_THE_MIDDLE, None], strict=True):
        requests.append(_request(x, good_id))
        if bad_id is not None:
            bad = pb.AttendRequest()
            bad.CopyFrom(BAD_IN_THE_MIDDLE[bad_id][0])
            bad.request_id = bad_id
            requests.append(bad)
    invalid_before = server.metric(
        "attention_requests_total", api="attention_stream", code="INVALID_ARGUMENT"
    )
    with grpc.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        call = stub.AttendStream(iter(requests), timeout=TIMEOUT_S)
        answers = {answer.request_id: answer for answer in call}
        assert call.code() == grpc.StatusCode.OK
    assert set(answers) == set(good) | set(BAD_IN_THE_MIDDLE)
    for bad_id, (_, code, message) in BAD_IN_THE_MIDDLE.items():
        assert answers[bad_id].WhichOneof("result") == "error"
        assert answers[bad_id].error.code == code.value[0], bad_id
        assert message in answers[bad_id].error.message
    for good_id, x in good.items():
        assert answers[good_id].WhichOneof("result") == "response"
        output = np.frombuffer(answers[good_id].response.output.data, np.float32)
        np.testing.assert_allclose(
            output.reshape(x.shape), attend_alone(reference, x)[0], atol=1e-5, rtol=0
        )
    invalid_after = server.metric(
        "attention_requests_total", api="attention_stream", code="INVALID_ARGUMENT"
    )
    assert invalid_after == invalid_before + 3
    assert (
        server.metric(
            "attention_requests_total", model="_unknown", api="attention_stream", code="NOT_FOUND"
        )
        >= 1
    )


# -- ModelStreamInfer -----------------------------------------------------------------------


def test_tritonclient_stream_api_works_unchanged(server: ServerProcess, reference) -> None:
    rng = np.random.default_rng(3)
    xs = {f"t{i}": _x(rng, 1 + i % 2, 3 + i) for i in range(10)}
    answers: queue.Queue = queue.Queue()
    v2 = triton.InferenceServerClient(server.target)
    v2.start_stream(callback=lambda result, error: answers.put((result, error)))
    weights = [
        triton.InferRequestedOutput("output"),
        triton.InferRequestedOutput("attention_weights"),
    ]
    for i, (rid, x) in enumerate(xs.items()):
        v2.async_stream_infer(
            "small", [_input(x)], request_id=rid, outputs=weights if i % 2 else None
        )
        if i == 4:  # bad messages in the middle
            v2.async_stream_infer(
                "small", [_input(np.ones((1, 2, 32), np.float32))], request_id="bad-d"
            )
            v2.async_stream_infer("nope", [_input(x)], request_id="bad-model")
    v2.stop_stream()  # half-closes and waits for every answer
    v2.close()
    got = [answers.get_nowait() for _ in range(answers.qsize())]
    errors = sorted(error.message() for result, error in got if error is not None)
    assert len(errors) == 2
    assert "expects d=64" in errors[0]
    assert "unknown model 'nope'" in errors[1]
    results = {result.get_response().id: result for result, error in got if error is None}
    assert set(results) == set(xs)
    for i, (rid, x) in enumerate(xs.items()):
        want_output, want_weights = attend_alone(reference, x)
        np.testing.assert_allclose(results[rid].as_numpy("output"), want_output, atol=1e-5)
        if i % 2:
            np.testing.assert_allclose(
                results[rid].as_numpy("attention_weights"), want_weights, atol=1e-6
            )
        else:
            assert results[rid].as_numpy("attention_weights") is None


def test_v2_stream_errors_name_the_request_they_answer(server: ServerProcess) -> None:
    """Triton's stream error has no status code; id and model say which request failed."""
    requests = [
        _v2_request(np.ones((1, 2, D), np.float32), "ok-1"),
        _v2_request(np.ones((1, 2, 32), np.float32), "bad-d"),
        _v2_request(np.ones((1, 2, D), np.float32), "bad-model", model="nope"),
        _v2_request(np.ones((1, 2, D), np.float32), "ok-2"),
    ]
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = {a.infer_response.id: a for a in stub.ModelStreamInfer(iter(requests))}
    assert set(answers) == {"ok-1", "bad-d", "bad-model", "ok-2"}
    assert "expects d=64" in answers["bad-d"].error_message
    assert answers["bad-d"].infer_response.model_name == "small"
    assert "unknown model 'nope'" in answers["bad-model"].error_message
    assert answers["bad-model"].infer_response.model_name == "nope"
    for ok in ("ok-1", "ok-2"):
        assert answers[ok].error_message == ""
        assert list(answers[ok].infer_response.outputs[0].shape) == [1, 2, D]
    assert server.metric("attention_requests_total", api="v2_stream", code="NOT_FOUND") >= 1


def test_tritonclient_aio_stream_infer(server: ServerProcess, reference) -> None:
    rng = np.random.default_rng(4)
    xs = {f"a{i}": _x(rng, 1, 2 + i) for i in range(6)}

    async def session() -> list:
        client = triton_aio.InferenceServerClient(server.target)

        async def requests() -> AsyncIterator[dict]:
            for rid, x in xs.items():
                yield {"model_name": "small", "inputs": [_input(x)], "request_id": rid}
            yield {"model_name": "small", "inputs": [_input(np.ones((1, 2, 32), np.float32))]}

        try:
            return [answer async for answer in client.stream_infer(requests())]
        finally:
            await client.close()

    got = asyncio.run(session())
    assert [error.message() for _, error in got if error is not None] == [
        "embeddings has d=32 (shape [1, 2, 32]); model 'small' expects d=64"
    ]
    for result, error in got:
        if error is None:
            x = xs[result.get_response().id]
            np.testing.assert_allclose(
                result.as_numpy("output"), attend_alone(reference, x)[0], atol=1e-5
            )
    assert len(got) == len(xs) + 1


# -- batching, back-pressure, cancellation, deadlines, shutdown ------------------------------


def test_streamed_and_unary_requests_share_one_batch(parked: ServerProcess, reference) -> None:
    """16 sequences each from two AttendStream messages, one ModelStreamInfer message and
    one unary Attend: exactly 64, so they fill one batch together."""
    rng = np.random.default_rng(5)
    xs = [_x(rng, 16, 4) for _ in range(4)]
    batches = parked.metric("attention_batches_total", model="small")
    with grpc.insecure_channel(parked.target) as channel:
        ours = attention_pb2_grpc.AttentionServiceStub(channel)
        v2 = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        streamed = ours.AttendStream(
            iter([_request(xs[0], "s0"), _request(xs[1], "s1")]), timeout=TIMEOUT_S
        )
        v2_streamed = v2.ModelStreamInfer(iter([_v2_request(xs[2], "v0")]), timeout=TIMEOUT_S)
        parked.wait_metric("attention_queue_depth_requests", 3)
        unary = ours.Attend(_request(xs[3], "u0"), timeout=TIMEOUT_S)
        answers = {a.request_id: a.response for a in streamed}
        (v2_answer,) = list(v2_streamed)
    assert parked.metric("attention_batches_total", model="small") == batches + 1
    assert unary.timing.batch_size == 64
    assert [answers[rid].timing.batch_size for rid in ("s0", "s1")] == [64, 64]
    for x, response in ((xs[0], answers["s0"]), (xs[1], answers["s1"]), (xs[3], unary)):
        output = np.frombuffer(response.output.data, np.float32).reshape(x.shape)
        np.testing.assert_allclose(output, attend_alone(reference, x)[0], atol=1e-5)
    v2_output = np.frombuffer(v2_answer.infer_response.raw_output_contents[0], np.float32)
    np.testing.assert_allclose(
        v2_output.reshape(xs[2].shape), attend_alone(reference, xs[2])[0], atol=1e-5
    )


def test_a_cancelled_stream_leaves_nothing_queued(parked: ServerProcess) -> None:
    dropped = parked.metric("attention_requests_dropped_total", reason="cancelled")
    batches = parked.metric("attention_batches_total", model="small")
    held = HeldOpen(_request(np.ones((4, D), np.float32), f"c{i}") for i in range(20))
    with grpc.insecure_channel(parked.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        call = stub.AttendStream(iter(held), timeout=TIMEOUT_S)
        try:
            parked.wait_metric("attention_queue_depth_requests", 20)
            call.cancel()
        finally:
            held.close()
        _queue_empty(parked)
        parked.wait_metric("attention_requests_dropped_total", dropped + 20, reason="cancelled")
        wait_for(
            lambda: parked.metric("attention_inflight_requests", api="attention_stream") == 0,
            what="no streamed request in flight",
        )
        # Healthy: a request that fills a batch alone is computed at once.
        full = stub.Attend(_request(np.ones((64, 2, D), np.float32)), timeout=TIMEOUT_S)
        assert list(full.output.shape) == [64, 2, D]
    assert parked.metric("attention_batches_total", model="small") == batches + 1


ABANDONING_CLIENT = """
import sys, numpy as np, tritonclient.grpc as triton
client = triton.InferenceServerClient(sys.argv[1])
client.start_stream(callback=lambda result, error: None)
for i in range(20):
    x = triton.InferInput("embeddings", [1, 4, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 4, 64), np.float32))
    client.async_stream_infer("small", [x], request_id=str(i))
print("sent", flush=True)
sys.stdin.read()
"""


def test_a_v2_client_that_goes_away_leaves_nothing_queued(parked: ServerProcess) -> None:
    dropped = parked.metric("attention_requests_dropped_total", reason="cancelled")
    client = subprocess.Popen(
        [sys.executable, "-c", ABANDONING_CLIENT, parked.target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "sent"
        parked.wait_metric("attention_queue_depth_requests", 20)
        assert parked.metric("attention_inflight_requests", api="v2_stream") == 20
    finally:
        client.kill()  # no cancel, no goodbye: the connection just drops
        client.wait()
    _queue_empty(parked)
    parked.wait_metric("attention_requests_dropped_total", dropped + 20, reason="cancelled")
    wait_for(
        lambda: parked.metric("attention_inflight_requests", api="v2_stream") == 0,
        what="no streamed request in flight",
    )
    with AttentionClient(parked.target) as attention:
        assert attention.is_serving()


def test_a_streams_deadline_applies_to_every_message(parked: ServerProcess) -> None:
    held = HeldOpen(_request(np.ones((4, D), np.float32), f"d{i}") for i in range(3))
    with grpc.insecure_channel(parked.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        try:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.AttendStream(iter(held), timeout=1.0))
        finally:
            held.close()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _queue_empty(parked)


BOUND = Settings.max_stream_inflight_requests  # AttendStream's default (see README)
ROOM = 1024  # sequences in a batch; requests park until a batch is full
ONE = np.ones((1, 2, D), np.float32)


def _stream_is_held_back(
    server: ServerProcess, api: str, start: Callable[[HeldOpen], Iterator], make: Callable
) -> list:
    """BOUND + 10 single-sequence requests on one stream, in a queue that holds BOUND + 1:
    the server reads BOUND of them and no more, so a unary request of ROOM - BOUND sequences
    fills the batch exactly; the last 10 are read once the first answers are out."""
    held = HeldOpen(make(ONE, f"b{i}") for i in range(BOUND + 10))
    call = start(held)
    with grpc.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        try:
            server.wait_metric("attention_queue_depth_requests", BOUND)
            assert server.metric("attention_inflight_requests", api=api) == BOUND
            filler = stub.Attend(
                _request(np.ones((ROOM - BOUND, 2, D), np.float32)), timeout=TIMEOUT_S
            )
            assert filler.timing.batch_size == ROOM  # so exactly BOUND of the stream were queued
            answers = [next(call) for _ in range(BOUND)]
            server.wait_metric("attention_queue_depth_requests", 10)  # the rest, read now
        finally:
            held.close()
        filler = stub.Attend(_request(np.ones((ROOM - 10, 2, D), np.float32)), timeout=TIMEOUT_S)
        assert filler.timing.batch_size == ROOM
    answers += list(call)
    assert call.code() == grpc.StatusCode.OK
    return answers


def test_the_inflight_bound_holds_a_stream_back_instead_of_failing(
    small_only: Path, grpc_gateway: str
) -> None:
    flags = (
        *PARKED,
        "--max-batch-size",
        str(ROOM),
        "--max-queue-size",
        str(BOUND + 1),
        "--max-stream-inflight-requests",
        str(BOUND),
    )
    with (
        ServerProcess(small_only, *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        ours = attention_pb2_grpc.AttentionServiceStub(channel)
        answers = _stream_is_held_back(
            server,
            "attention_stream",
            lambda held: ours.AttendStream(iter(held), timeout=TIMEOUT_S),
            _request,
        )
        assert [a.error.message for a in answers if a.HasField("error")] == []
        assert len({a.request_id for a in answers}) == BOUND + 10
        v2 = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        v2_answers = _stream_is_held_back(
            server,
            "v2_stream",
            lambda held: v2.ModelStreamInfer(iter(held), timeout=TIMEOUT_S),
            _v2_request,
        )
        assert [a.error_message for a in v2_answers if a.error_message] == []
        assert len({a.infer_response.id for a in v2_answers}) == BOUND + 10
        assert server.metric("attention_requests_total", code="RESOURCE_EXHAUSTED") == 0


def test_sigterm_finishes_a_streams_accepted_requests(small_only: Path, grpc_gateway: str) -> None:
    """The client never half-closes: after answering all it read, the server ends the stream
    with UNAVAILABLE (send the rest elsewhere) instead of holding it open until killed."""
    server = ServerProcess(small_only, *PARKED, "--grace-period-s", "20")
    with server, grpc.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        held = HeldOpen(_request(np.ones((1 + i, D), np.float32), f"s{i}") for i in range(30))
        call = stub.AttendStream(iter(held), timeout=TIMEOUT_S)
        try:
            server.wait_metric("attention_queue_depth_requests", 30)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            answers = [next(call) for _ in range(30)]
            with pytest.raises(grpc.RpcError):
                next(call)  # no 31st answer: the end of the call, with its status
            assert time.monotonic() - started < 10  # not the 20 s grace period
        finally:
            held.close()
        assert call.code() == grpc.StatusCode.UNAVAILABLE
        assert "every request read from this stream was answered" in call.details()
        assert sorted(a.request_id for a in answers) == sorted(f"s{i}" for i in range(30))
        assert all(a.WhichOneof("result") == "response" for a in answers)
        assert server.process.wait(30) == 0, server.log


# -- the stream machinery alone, behind a real grpc.aio server -------------------------------


class _Flaky(attention_pb2_grpc.AttentionServiceServicer):
    """Answers each request at once, except that 'boom' ones fail unexpectedly."""

    async def AttendStream(self, requests, context) -> None:
        calls = StreamCalls(
            api="attention_stream",
            answer=self._answer,
            failure=lambda request, code, message: pb.AttendStreamResponse(
                request_id=request.request_id,
                error=pb.StreamError(code=code.value[0], message=message),
            ),
            model_label=lambda request: "_unknown",
            request_id=lambda request: request.request_id,
        )
        await serve_stream(calls, requests, context, max_inflight=2)

    async def _answer(self, request: pb.AttendRequest, context) -> pb.AttendStreamResponse:
        if request.request_id.startswith("boom"):
            raise RuntimeError("the disk is on fire")
        return pb.AttendStreamResponse(request_id=request.request_id, response=pb.AttendResponse())


def test_an_unexpected_error_is_internal_logged_and_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def session() -> tuple[list[pb.AttendStreamResponse], grpc.StatusCode]:
        server = grpc.aio.server()
        add_servicer(server, attention_pb2_grpc.add_AttentionServiceServicer_to_server, _Flaky())
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                ids = ["a", "boom-1", "b", "c", "boom-2", "d"]
                call = attention_pb2_grpc.AttentionServiceStub(channel).AttendStream(
                    iter([pb.AttendRequest(request_id=rid) for rid in ids]), timeout=TIMEOUT_S
                )
                return [answer async for answer in call], await call.code()
        finally:
            await server.stop(None)

    answers, code = asyncio.run(session())
    assert code == grpc.StatusCode.OK
    by_id = {answer.request_id: answer for answer in answers}
    assert sorted(by_id) == ["a", "b", "boom-1", "boom-2", "c", "d"]
    for rid in ("boom-1", "boom-2"):
        assert by_id[rid].error.code == grpc.StatusCode.INTERNAL.value[0]
        assert (
            by_id[rid].error.message == f"internal error; request_id='{rid}' is in the server log"
        )
        assert "disk" not in by_id[rid].error.message
    assert all(by_id[rid].HasField("response") for rid in "abcd")
    logged = [r for r in caplog.records if "internal error in attention_stream" in r.getMessage()]
    assert len(logged) == 2
    assert all(r.exc_info is not None for r in logged)


class _Aborted(Exception):
    pass


class _PastItsDeadline:
    """A call's context, its deadline passed while its messages were answered, before gRPC's
    own timer ended the call (the worker may notice a passed deadline first)."""

    def __init__(self, remaining_s: float) -> None:
        self.remaining_s = remaining_s
        self.written: list[bytes] = []  # the answers, serialized
        self.ended: tuple[grpc.StatusCode, str] | None = None  # None: returned, status OK

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def time_remaining(self) -> float:
        return self.remaining_s

    async def write(self, message: WireMessage) -> None:
        self.written.append(b"".join(message.chunks))

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.ended = (code, details)
        raise _Aborted


@pytest.mark.parametrize(
    ("remaining_s", "ended"),
    [(-0.001, (grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)), (5, None)],
)
def test_a_stream_whose_deadline_has_passed_ends_deadline_exceeded(
    remaining_s: float, ended: tuple[grpc.StatusCode, str] | None
) -> None:
    """A call whose deadline passed ends DEADLINE_EXCEEDED, whatever its messages' answers
    (here one answered before it ended); it ended OK when gRPC's timer came too late."""

    async def requests() -> AsyncIterator[pb.AttendRequest]:
        yield pb.AttendRequest(request_id="a")

    async def answer(request: pb.AttendRequest, context: object) -> pb.AttendStreamResponse:
        return pb.AttendStreamResponse(request_id=request.request_id)

    calls = StreamCalls(
        api="attention_stream",
        answer=answer,
        failure=lambda request, code, message: pb.AttendStreamResponse(),
        model_label=lambda request: "_unknown",
        request_id=lambda request: request.request_id,
    )
    context = _PastItsDeadline(remaining_s)
    with contextlib.suppress(_Aborted):
        asyncio.run(serve_stream(calls, requests(), context, max_inflight=2))  # type: ignore[arg-type]
    assert context.ended == ended
    assert [pb.AttendStreamResponse.FromString(m).request_id for m in context.written] == ["a"]
