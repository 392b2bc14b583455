"""V2's health calls (ServerLive, ServerReady, ModelReady): the same answers and metrics with
the gRPC gateway and without it; behind the gateway they are answered from what the worker
publishes, so they are answered while the front end's process is stopped (SIGSTOP): a probe
never waits for that process to be scheduled on a core busy with inference. A message the
gateway does not read (an unknown field) still goes to the front end."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness import poll_until
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from tests.harness.server_process import ServerProcess, child_pids

pytestmark = pytest.mark.usefixtures("grpc_gateway")

V2 = "/inference.GRPCInferenceService/"
# (method, request, the answer's field, its value, the model label of the call's metrics):
# "small" is served in versions 1 and 2 and is the default model.
CASES = [
    ("ServerLive", v2.ServerLiveRequest(), "live", True, "_server"),
    ("ServerReady", v2.ServerReadyRequest(), "ready", True, "_server"),
    ("ModelReady", v2.ModelReadyRequest(name="small"), "ready", True, "small"),
    ("ModelReady", v2.ModelReadyRequest(), "ready", True, "small"),
    ("ModelReady", v2.ModelReadyRequest(name="small", version="2"), "ready", True, "small"),
    ("ModelReady", v2.ModelReadyRequest(name="small", version="3"), "ready", False, "small"),
    ("ModelReady", v2.ModelReadyRequest(name="small", version="01"), "ready", False, "small"),
    ("ModelReady", v2.ModelReadyRequest(name="mha", version="1"), "ready", True, "mha"),
    ("ModelReady", v2.ModelReadyRequest(name="nope"), "ready", False, "_unknown"),
]
# grpc.health.v1's Check: (service, status; None: NOT_FOUND).
SERVING = health_pb2.HealthCheckResponse.SERVING
CHECKS = [
    ("", SERVING),
    ("inference.GRPCInferenceService", SERVING),
    ("attention.v1.AttentionService", SERVING),
    ("small", SERVING),
    ("nope", None),
]
RESPONSES = {
    "ServerLive": v2.ServerLiveResponse,
    "ServerReady": v2.ServerReadyResponse,
    "ModelReady": v2.ModelReadyResponse,
}


@pytest.fixture(scope="module")
def health_server(model_repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_repository, "--default-model", "small") as server:
        yield server


def call(channel: grpc.Channel, method: str, request: bytes, timeout_s: float) -> bytes:
    """One unary call with the request's bytes as they are; the answer's bytes."""
    answer: bytes = channel.unary_unary(V2 + method)(request, timeout=timeout_s)
    return answer


def answered(channel: grpc.Channel, timeout_s: float = 10) -> list[tuple[str, bool]]:
    """Each case's answer: (method, value)."""
    values = []
    for method, request, field, _, _ in CASES:
        reply = RESPONSES[method].FromString(
            call(channel, method, request.SerializeToString(), timeout_s)
        )
        values.append((method, getattr(reply, field)))
    return values


def checked(
    channel: grpc.Channel,
    timeout_s: float = 10,
    services: list[tuple[str, int | None]] = CHECKS,
) -> list[tuple[str, int | None]]:
    """Each Check's status (None: NOT_FOUND)."""
    stub, statuses = health_pb2_grpc.HealthStub(channel), []
    for service, _ in services:
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            statuses.append((service, stub.Check(request, timeout=timeout_s).status))
        except grpc.RpcError as err:
            # Python's health service answers an unknown name NOT_FOUND without a message.
            found = (err.code(), err.details())
            statuses.append((service, None if found == (grpc.StatusCode.NOT_FOUND, "") else -1))
    return statuses


def test_answers_and_metrics_are_python_s(health_server: ServerProcess) -> None:
    expected = [(method, value) for method, _, _, value, _ in CASES]
    counted = [
        (label, health_server.metric("attention_requests_total", model=label, api="v2", code="OK"))
        for *_, label in CASES
    ]
    with grpc.insecure_channel(health_server.target) as channel:
        assert answered(channel) == expected
        assert checked(channel) == CHECKS
    for label, before in counted:
        calls = sum(1 for *_, other in CASES if other == label)
        health_server.wait_metric(
            "attention_requests_total", before + calls, model=label, api="v2", code="OK"
        )


def test_answered_with_the_front_end_stopped(
    health_server: ServerProcess, grpc_gateway: str
) -> None:
    if grpc_gateway != "on":
        pytest.skip("without the gateway the front end answers every call")
    frontend = child_pids(health_server)["frontend-0"]
    # ModelReady with an unknown field (3, a varint): Python reads it; the gateway does not.
    unread = v2.ModelReadyRequest(name="small").SerializeToString() + b"\x18\x01"
    with grpc.insecure_channel(health_server.target) as channel:
        grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
            v2.ServerLiveRequest(), timeout=10
        )  # the connection is up before the front end stops
        os.kill(frontend, signal.SIGSTOP)
        try:
            assert answered(channel, timeout_s=5) == [(m, value) for m, _, _, value, _ in CASES]
            assert checked(channel, timeout_s=5) == CHECKS
            with pytest.raises(grpc.RpcError) as waited:
                call(channel, "ModelReady", unread, timeout_s=1)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            os.kill(frontend, signal.SIGCONT)
        assert v2.ModelReadyResponse.FromString(call(channel, "ModelReady", unread, 10)).ready


def test_a_restricted_health_group_needs_its_key(model_repository: Path, tmp_path: Path) -> None:
    """Checked where the call is answered, by the rule and in the words of Python's check."""
    key_file = tmp_path / "probe-key"
    key_file.write_text("letmein")
    keyed = (("x-probe-key", "letmein"),)
    flags = ("--default-model", "small", "--restricted-api", f"health:x-probe-key=@{key_file}")
    server = ServerProcess(model_repository, *flags)  # not entered: its wait needs no key
    try:
        server.wait_bound()
        with grpc.insecure_channel(server.target) as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            poll_until(
                lambda: stub.ServerReady(v2.ServerReadyRequest(), timeout=10, metadata=keyed),
                lambda answer: answer.ready,
                what="ServerReady with the key",
                timeout_s=60,
            )
            for metadata in ((), (("x-probe-key", "guess"),)):
                with pytest.raises(grpc.RpcError) as denied:
                    stub.ServerReady(v2.ServerReadyRequest(), timeout=10, metadata=metadata)
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "'x-probe-key'" in str(denied.value.details())
                assert "letmein" not in str(denied.value.details())
            request = v2.ModelReadyRequest(name="small")
            assert stub.ModelReady(request, timeout=10, metadata=keyed).ready
            server.wait_metric("attention_restricted_api_denials_total", 2, group="health")
    finally:
        server.kill()


def test_an_unloaded_model_is_not_serving_and_not_ready(model_repository: Path) -> None:
    """The per-model health entry stays, NOT_SERVING, after its model is unloaded (a name
    never served has none), and ModelReady says no: the same in both modes."""
    flags = ("--model-control-mode", "explicit", "--default-model", "small")
    with (
        ServerProcess(model_repository, *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        v2_stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        v2_stub.RepositoryModelUnload(v2.RepositoryModelUnloadRequest(model_name="mha"), timeout=60)
        poll_until(
            lambda: v2_stub.ModelReady(v2.ModelReadyRequest(name="mha"), timeout=10).ready,
            lambda ready: not ready,
            what="ModelReady of an unloaded model",
            timeout_s=30,
        )
        checks = [("mha", health_pb2.HealthCheckResponse.NOT_SERVING), *CHECKS]
        assert checked(channel, services=checks) == checks
