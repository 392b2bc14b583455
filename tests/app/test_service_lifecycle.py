"""Queueing, deadlines, cancellation, health, graceful shutdown and broken models."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness import loopback_server
from service.client import AttentionClient
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from tests.harness.gateway_modes import OFF_WHEN_HEAVY
from tests.harness.providers import serving_provider
from tests.harness.server_process import ServerProcess, gateway_mode, worker_pid

D = 64  # the "small" model keeps these tests quick
PARKED = ("--max-queue-delay-ms", "60000", "--max-batch-size", "64")  # requests wait in the queue


def _request(seq: int = 4) -> pb.AttendRequest:
    x = np.ones((seq, D), np.float32)
    return pb.AttendRequest(
        model="small", embeddings=pb.Tensor(shape=[seq, D], dtype=pb.FLOAT32, data=x.tobytes())
    )


def _stub(server: ServerProcess) -> tuple[grpc.Channel, attention_pb2_grpc.AttentionServiceStub]:
    channel = grpc.insecure_channel(server.target)
    return channel, attention_pb2_grpc.AttentionServiceStub(channel)


@pytest.mark.usefixtures("grpc_gateway")  # refusals, deadlines, cancels: each path's own
def test_full_queue_rejects_at_once_and_drain_finishes_the_rest(model_repository: Path) -> None:
    with ServerProcess(model_repository, *PARKED, "--max-queue-size", "3") as server:
        channel, stub = _stub(server)
        parked = [stub.Attend.future(_request(), timeout=60) for _ in range(3)]
        server.wait_metric("attention_queue_depth_requests", 3)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Attend(_request(), timeout=30)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue_size=3" in caught.value.details()
        assert time.monotonic() - started < 5, "rejection should not wait for the queue"
        assert server.terminate() == 0, server.log
        for call in parked:
            assert call.result().output.shape == [4, D]
        channel.close()


@pytest.mark.usefixtures("grpc_gateway")  # refusals, deadlines, cancels: each path's own
def test_expired_and_cancelled_requests_are_never_computed(model_repository: Path) -> None:
    with ServerProcess(model_repository, *PARKED) as server:
        channel, stub = _stub(server)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Attend(_request(), timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        server.wait_metric("attention_requests_dropped_total", 1, model="small", reason="deadline")

        call = stub.Attend.future(_request(), timeout=60)
        server.wait_metric("attention_queue_depth_requests", 1)
        call.cancel()
        server.wait_metric("attention_requests_dropped_total", 1, model="small", reason="cancelled")
        assert server.metric("attention_queue_depth_requests") == 0
        assert server.metric("attention_batches_total", model="small") == 0
        channel.close()


@pytest.mark.usefixtures("grpc_gateway")  # refusals, deadlines, cancels: each path's own
def test_deadline_that_passes_in_the_queue_is_dropped_by_the_server(model_repository: Path) -> None:
    """A deadline shorter than the queue delay: the server itself drops it before compute."""
    flags = ("--max-queue-delay-ms", "400", "--max-batch-size", "64")
    with ServerProcess(model_repository, *flags) as server:
        channel, stub = _stub(server)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Attend(_request(), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        server.wait_metric("attention_requests_dropped_total", 1, model="small")
        ok = stub.Attend(_request(), timeout=30)  # the next one with time to spare is served
        assert ok.output.shape == [4, D]
        assert server.metric("attention_batches_total", model="small") == 1
        channel.close()


@pytest.mark.usefixtures("grpc_gateway")  # refusals, deadlines, cancels: each path's own
def test_sigterm_under_load_finishes_accepted_requests_and_exits_zero(
    model_repository: Path,
) -> None:
    server = ServerProcess(model_repository, *PARKED, "--grace-period-s", "20")
    with server:
        channel, stub = _stub(server)
        accepted = [stub.Attend.future(_request(seq=1 + i % 40), timeout=60) for i in range(40)]
        server.wait_metric("attention_queue_depth_requests", 40)
        started = time.monotonic()
        server.process.send_signal(subprocess.signal.SIGTERM)
        for call in accepted:
            assert call.result().output.shape[1] == D
        refused = None
        while server.process.poll() is None or refused is None:
            try:
                stub.Attend(_request(), timeout=5)
            except grpc.RpcError as err:
                refused = err.code()
                if server.process.poll() is not None:
                    break
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert server.process.wait(30) == 0, server.log
        assert time.monotonic() - started < 20
        channel.close()
    assert "draining" in server.log


@OFF_WHEN_HEAVY  # the gateway refuses calls until ready by itself; ~12 s a mode
def test_health_goes_from_not_serving_to_serving_after_warm_up(
    model_repository: Path, grpc_gateway: str
) -> None:
    """Front ends bind before the worker is warm: health says NOT_SERVING and calls are
    refused with UNAVAILABLE until it is. The worker is held (SIGSTOP) inside its batch-cap
    measurement, so the window cannot close before the checks."""
    server = ServerProcess(model_repository, env={"ATTENTION_BATCH_CAP_BUDGET_S": "5"})
    try:
        server.wait_bound()
        worker = worker_pid(server)
        os.kill(worker, signal.SIGSTOP)
        channel, stub = _stub(server)
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="attention.v1.AttentionService")
        try:
            status = health.Check(check, timeout=30).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                stub.Attend(_request(3), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            os.kill(worker, signal.SIGCONT)
        server.wait_serving(timeout_s=120)
        assert health.Check(check, timeout=30).status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Attend(_request(3), timeout=30).output.shape == [3, D]
        channel.close()
    finally:
        server.kill()


@pytest.mark.usefixtures("grpc_gateway")  # the gateway answers from the served set it is sent
def test_broken_models_are_skipped_and_the_rest_served(
    model_repository: Path, tmp_path: Path
) -> None:
    shutil.copytree(model_repository / "small", tmp_path / "small")
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"this is not onnx")
    (tmp_path / "small" / "latest").mkdir()
    with ServerProcess(tmp_path) as server, AttentionClient(server.target) as client:
        assert [m.name for m in client.list_models()] == ["small"]
        assert client.attend(np.ones((2, D), np.float32), model="small").output.shape == (2, D)
    assert "not serving broken version 1" in server.log
    assert "a version folder's name must be" in server.log


def test_empty_repository_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    done = subprocess.run(
        loopback_server(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "no servable model" in done.stderr


def test_a_taken_port_fails_fast(server: ServerProcess, model_repository: Path) -> None:
    env = {**os.environ, "ATTENTION_GRPC_GATEWAY": gateway_mode(server)}  # the gateway binds too
    for flag, port in (("--grpc-port", server.grpc_port), ("--metrics-port", server.metrics_port)):
        done = subprocess.run(
            [*loopback_server(model_repository), flag, str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )
        assert done.returncode == 1, done.stderr
        assert "cannot bind" in done.stderr


def test_a_port_left_in_time_wait_by_a_previous_run_is_free(mha_repository: Path) -> None:
    """A restart on the same port within a minute of the last run, whose server closed its
    connections first (they stay in TIME_WAIT on the port): it serves. Before, the port check
    bound without SO_REUSEADDR and refused to start: 'Address already in use'."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
            client.recv(1)
    with ServerProcess(mha_repository, "--grpc-port", str(port)) as restarted:
        assert restarted.grpc_port == port
        with grpc.insecure_channel(restarted.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_move_as_requests_go_through(
    server: ServerProcess, client: AttentionClient
) -> None:
    def snapshot() -> dict[str, float]:
        return {
            "requests": server.metric("attention_requests_total", model="small", code="OK"),
            "latency": server.metric("attention_request_duration_seconds_count", model="small"),
            "queue": server.metric("attention_queue_duration_seconds_count", model="small"),
            "compute": server.metric("attention_compute_duration_seconds_count", model="small"),
            "batch": server.metric("attention_batch_size_sequences_sum", model="small"),
            "padding": server.metric("attention_batch_padding_ratio_count", model="small"),
        }

    before = snapshot()
    for seq in (3, 7, 11):
        client.attend(np.ones((2, seq, D), np.float32), model="small")
    after = snapshot()
    assert after["requests"] - before["requests"] == 3
    assert after["latency"] - before["latency"] == 3
    assert after["queue"] - before["queue"] == 3
    assert after["batch"] - before["batch"] == 6
    assert after["compute"] > before["compute"]
    assert after["padding"] > before["padding"]
    assert server.metric("attention_model_ready", model="small", version="2") == 1
    provider = serving_provider()
    assert server.metric("attention_engine_info", model="mha", provider=provider) == 1
    names = {name for name, _ in server.metrics()}
    assert {"attention_queue_depth_requests", "attention_inflight_requests"} <= names
