"""Refusals and readiness at the edge: the worker publishes its queue's fill in a status page
that front ends and gateways read, so a full queue is refused, and health answered, without
asking the worker. Shown with the worker stopped (SIGSTOP): nothing that needs it could
answer then."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from tests.harness.server_process import ServerProcess, worker_pid

# Every server here runs with the gRPC gateway, then without it.
pytestmark = pytest.mark.usefixtures("grpc_gateway")

D = 64  # conftest's "small" model
QUEUE = 4
PARKED = (
    "--default-model",
    "small",
    "--max-queue-delay-ms",
    "60000",
    "--max-batch-size",
    "64",
    "--max-queue-size",
    str(QUEUE),
    "--watchdog-timeout-s",
    "120",
)
# The same bounds, with batches that start at once.
PROMPT = tuple("0" if flag == "60000" else flag for flag in PARKED)


def _attend(seq: int = 8) -> pb.AttendRequest:
    x = np.ones((seq, D), np.float32)
    return pb.AttendRequest(
        embeddings=pb.Tensor(shape=[seq, D], dtype=pb.FLOAT32, data=x.tobytes())
    )


def _infer(seq: int = 8) -> v2.ModelInferRequest:
    request = v2.ModelInferRequest(model_name="small")
    request.inputs.add(name="embeddings", datatype="FP32", shape=[1, seq, D])
    request.raw_input_contents.append(np.ones((1, seq, D), np.float32).tobytes())
    return request


@pytest.fixture
def stopped_worker(
    model_repository: Path, grpc_gateway: str
) -> Iterator[tuple[ServerProcess, list]]:
    """A server whose queue holds QUEUE parked requests, and whose worker is then stopped."""
    with ServerProcess(model_repository, *PARKED) as server:
        channel = grpc.insecure_channel(server.target)
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        parked = [stub.Attend.future(_attend(), timeout=120) for _ in range(QUEUE)]
        server.wait_metric("attention_queue_depth_requests", QUEUE)
        worker = worker_pid(server)
        os.kill(worker, signal.SIGSTOP)
        try:
            yield server, parked
        finally:
            os.kill(worker, signal.SIGCONT)
            for call in parked:
                call.cancel()
            channel.close()


def test_a_full_queue_is_refused_without_asking_the_worker(stopped_worker) -> None:
    """Both APIs get the worker's own refusal, in its words, while the worker cannot answer."""
    server, _ = stopped_worker
    expected = f"queue full: {QUEUE} requests waiting (max_queue_size={QUEUE}); retry with backoff"
    with grpc.insecure_channel(server.target) as channel:
        calls = {
            "attend": lambda: attention_pb2_grpc.AttentionServiceStub(channel).Attend(
                _attend(), timeout=20
            ),
            "v2": lambda: grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                _infer(), timeout=20
            ),
        }
        for name, call in calls.items():
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
                assert refused.value.details() == expected, name


def test_requests_on_their_way_to_the_worker_count_as_queued(
    model_repository: Path, grpc_gateway: str
) -> None:
    """With the worker stopped before anything is queued, what a front end sends it waits
    unread in the link, where the status page cannot see it: the front end counts it, so the
    request past the queue's bound is refused at once, in the worker's words, and the ones
    sent are computed once the worker runs again."""
    with (
        ServerProcess(model_repository, *PROMPT) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        stub.Attend(_attend(), timeout=60)  # the status page is published
        worker = worker_pid(server)
        os.kill(worker, signal.SIGSTOP)
        try:
            sent = [stub.Attend.future(_attend(), timeout=120) for _ in range(QUEUE)]
            server.wait_metric("attention_inflight_requests", QUEUE, api="attention")
            v2_stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            # A call that overtook one of the four on its way in is sent too, and counted.
            admitted, refused = 0, None
            while refused is None and admitted < 3:
                try:
                    v2_stub.ModelInfer(_infer(), timeout=5)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        refused = err
                    admitted += refused is None
            assert refused is not None, "every call was sent to the stopped worker"
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            waiting = QUEUE + admitted
            assert refused.details() == (
                f"queue full: {waiting} requests waiting (max_queue_size={QUEUE}); "
                "retry with backoff"
            )
        finally:
            os.kill(worker, signal.SIGCONT)
        assert [list(call.result(timeout=60).output.shape) for call in sent] == [[8, D]] * QUEUE


def test_readiness_is_answered_while_the_worker_is_stopped(stopped_worker) -> None:
    server, _ = stopped_worker
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        v2_stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert v2_stub.ServerReady(v2.ServerReadyRequest(), timeout=10).ready
        assert v2_stub.ModelReady(v2.ModelReadyRequest(name="small"), timeout=10).ready


def test_a_queue_full_by_bytes_is_refused_in_the_workers_words(
    model_repository: Path, grpc_gateway: str
) -> None:
    """One parked request of 2 KiB under a 3 KiB bound: the next 2 KiB one is refused by
    bytes, with the same numbers the worker would give."""
    flags = (*PARKED, "--max-queue-bytes", "3072")
    with (
        ServerProcess(model_repository, *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        parked = stub.Attend.future(_attend(seq=8), timeout=60)  # 8 x 64 x 4 = 2048 bytes
        server.wait_metric("attention_queue_depth_requests", 1)
        v2_stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            v2_stub.ModelInfer(_infer(seq=8), timeout=20)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            "queue full: 2048 bytes waiting, this request adds 2048 "
            "(max_queue_bytes=3072); retry with backoff"
        )
        parked.cancel()
