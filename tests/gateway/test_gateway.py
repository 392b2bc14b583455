"""--grpc-gateway on: the Go gateway serves the gRPC port, answers plain V2 ModelInfer and
Attend calls itself and hands everything else to the Python front end. Real servers, real gRPC."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import h2.events
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from bench.harness import wait_for
from service.client import attend_request
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.generated.inference import grpc_service_pb2 as v2pb
from service.generated.inference import grpc_service_pb2_grpc as v2grpc
from tests.harness.h2_raw import RawGrpc
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import (
    ServerProcess,
    child_pids,
    rss_bytes,
    settled_bytes,
    worker_pid,
)

GATEWAY_PID = re.compile(r"started frontend-\d+-gateway \(pid (\d+)\)")


def gateway_pids(server: ServerProcess) -> list[int]:
    return [int(pid) for pid in GATEWAY_PID.findall(server.log)]


def infer(
    client: triton.InferenceServerClient,
    x: np.ndarray,
    *,
    model: str = "mha",
    outputs: tuple[str, ...] = ("output",),
    request_id: str = "",
    datatype: str = "FP32",
    timeout_s: float | None = None,
) -> triton.InferResult:
    tensor = triton.InferInput("embeddings", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    requested = [triton.InferRequestedOutput(name) for name in outputs]
    return client.infer(
        model, [tensor], outputs=requested, request_id=request_id, client_timeout=timeout_s
    )


def status_of_call(target: str, x: np.ndarray) -> str:
    """One ModelInfer on a connection of its own: "OK" or the status code it ended with."""
    with triton.InferenceServerClient(target) as client:
        try:
            infer(client, x, timeout_s=20)
        except InferenceServerException as err:
            return str(err.status())
        return "OK"


@pytest.fixture(scope="module")
def gateway(model_repository: Path) -> Iterator[ServerProcess]:
    with ServerProcess(model_repository, "--grpc-gateway", "on") as server:
        assert gateway_pids(server), server.log
        yield server


@pytest.fixture
def v2(gateway: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(gateway.target) as client:
        yield client


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_answers_match_torch_with_and_without_weights(
    gateway: ServerProcess, v2: triton.InferenceServerClient
) -> None:
    layer = layer_for(512, 8)
    x = rng().standard_normal((3, 20, 512), dtype=np.float32)
    expected_out, expected_weights = attend_alone(layer, x)
    both = infer(v2, x, outputs=("attention_weights", "output"), request_id="req-7")
    np.testing.assert_allclose(both.as_numpy("output"), expected_out, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(both.as_numpy("attention_weights"), expected_weights, atol=1e-5)
    response = both.get_response()
    assert (response.id, response.model_name, response.model_version) == ("req-7", "mha", "1")
    assert [t.name for t in response.outputs] == ["attention_weights", "output"]
    alone = infer(v2, x)
    assert [t.name for t in alone.get_response().outputs] == ["output"]
    np.testing.assert_allclose(alone.as_numpy("output"), expected_out, atol=1e-4, rtol=1e-4)


def test_attend_is_answered_as_the_python_front_end_answers_it(gateway: ServerProcess) -> None:
    """Plain Attend calls take the fast path: the same fields, shapes and dtypes, torch's
    numbers, counted under api="attention"."""
    layer = layer_for(512, 8)
    labels = {"model": "mha", "api": "attention", "code": "OK"}
    before = gateway.metric("attention_requests_total", **labels)
    with grpc.insecure_channel(gateway.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        for x in (
            rng(3).standard_normal((7, 512), dtype=np.float32),
            rng(4).standard_normal((2, 5, 512), dtype=np.float32),
        ):
            expected_out, expected_weights = attend_alone(layer, x)
            request = attend_request(x, return_attention_weights=True)
            request.request_id = "attend-1"
            response = stub.Attend(request, timeout=20)
            assert (response.model, response.model_version, response.request_id) == (
                "mha",
                "1",
                "attend-1",
            )
            assert list(response.output.shape) == list(x.shape)
            assert response.output.dtype == pb.FLOAT32
            out = np.frombuffer(response.output.data, np.float32).reshape(x.shape)
            np.testing.assert_allclose(out, expected_out, atol=1e-4, rtol=1e-4)
            weights_shape = [*x.shape[:-2], 8, x.shape[-2], x.shape[-2]]
            assert list(response.attention_weights.shape) == weights_shape
            weights = np.frombuffer(response.attention_weights.data, np.float32)
            np.testing.assert_allclose(weights.reshape(weights_shape), expected_weights, atol=1e-5)
            assert response.timing.batch_size >= x.reshape(-1, x.shape[-2], 512).shape[0]
            assert response.timing.compute_us > 0
            plain = stub.Attend(attend_request(x), timeout=20)
            assert not plain.HasField("attention_weights")
            assert not plain.request_id
            np.testing.assert_allclose(
                np.frombuffer(plain.output.data, np.float32).reshape(x.shape),
                expected_out,
                atol=1e-4,
                rtol=1e-4,
            )
    gateway.wait_metric("attention_requests_total", before + 4, **labels)
    assert gateway.metric("attention_undelivered_answer_bytes") == 0


def test_float16_model_and_named_version(
    gateway: ServerProcess, v2: triton.InferenceServerClient
) -> None:
    x = rng(1).standard_normal((1, 5, 64)).astype(np.float16)
    result = infer(v2, x, model="half", datatype="FP16")
    assert result.as_numpy("output").dtype == np.float16
    assert result.as_numpy("output").shape == (1, 5, 64)
    tensor = triton.InferInput("embeddings", [1, 4, 64], "FP32")
    tensor.set_data_from_numpy(rng(2).standard_normal((1, 4, 64), dtype=np.float32))
    old = v2.infer("small", [tensor], model_version="1")
    new = v2.infer("small", [tensor])
    assert old.get_response().model_version == "1"
    assert new.get_response().model_version == "2"
    assert not np.allclose(old.as_numpy("output"), new.as_numpy("output"))


def test_calls_it_does_not_answer_get_the_python_front_ends_answers(
    gateway: ServerProcess, v2: triton.InferenceServerClient
) -> None:
    """Errors come from one place: the gateway hands over whatever is not plain."""
    x = rng().standard_normal((1, 4, 512), dtype=np.float32)
    x[0, 1, 2] = np.inf
    with pytest.raises(InferenceServerException, match="non-finite") as err:
        infer(v2, x)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="expects d=512"):
        infer(v2, rng().standard_normal((1, 4, 64), dtype=np.float32))
    with pytest.raises(InferenceServerException) as missing:
        infer(v2, rng().standard_normal((1, 4, 512), dtype=np.float32), model="nope")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="max_seq_len"):
        infer(v2, np.zeros((1, 513, 512), dtype=np.float32))
    # The rest of the V2 API, health and the Attention API go through to Python.
    assert v2.is_server_ready()
    assert v2.get_model_metadata("mha").name == "mha"
    with grpc.insecure_channel(gateway.target) as channel:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def _v2_stream_request(
    x: np.ndarray, request_id: str, input_name: str = "embeddings"
) -> v2pb.ModelInferRequest:
    request = v2pb.ModelInferRequest(model_name="mha", id=request_id)
    request.inputs.add(name=input_name, datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def test_streams_mixing_plain_and_other_messages_answer_each_as_the_python_front_end(
    gateway: ServerProcess,
) -> None:
    """The gateway answers a stream's plain messages and hands the others to the Python front
    end in one stream of its own: every message gets its answer (torch's numbers) or its
    error, named by its id, and each is counted under the stream's api."""
    layer = layer_for(512, 8)
    xs = [rng(i).standard_normal((1, 3 + i, 512), dtype=np.float32) for i in range(6)]
    bad = {1: "input name", 4: "shape"}
    requests = []
    for i, x in enumerate(xs):
        if i == 1:
            requests.append(_v2_stream_request(x, f"r{i}", input_name="nope"))
        elif i == 4:
            requests.append(_v2_stream_request(x[..., :7].copy(), f"r{i}"))
        else:
            requests.append(_v2_stream_request(x, f"r{i}"))
    ok = {"model": "mha", "api": "v2_stream", "code": "OK"}
    invalid = {"model": "mha", "api": "v2_stream", "code": "INVALID_ARGUMENT"}
    ok_before = gateway.metric("attention_requests_total", **ok)
    invalid_before = gateway.metric("attention_requests_total", **invalid)
    with grpc.insecure_channel(gateway.target) as channel:
        answers = list(
            v2grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=30)
        )
        assert sorted(a.infer_response.id for a in answers) == [f"r{i}" for i in range(6)]
        for answer in answers:
            i = int(answer.infer_response.id[1:])
            assert answer.infer_response.model_name == "mha"
            if i in bad:
                assert "expect" in answer.error_message, (bad[i], answer.error_message)
                continue
            assert not answer.error_message
            out = answer.infer_response.outputs[0]
            assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", [1, 3 + i, 512])
            got = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32)
            expected, _ = attend_alone(layer, xs[i])
            np.testing.assert_allclose(got.reshape(xs[i].shape), expected, atol=1e-4, rtol=1e-4)
        # AttendStream: the same, with its own envelope and error message.
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        attends = [
            attend_request(xs[0][0]),
            attend_request(xs[2][0][:, :3].copy()),
            attend_request(xs[3][0], return_attention_weights=True),
        ]
        for i, request in enumerate(attends):
            request.request_id = f"a{i}"
        replies = {r.request_id: r for r in stub.AttendStream(iter(attends), timeout=30)}
    assert sorted(replies) == ["a0", "a1", "a2"]
    assert replies["a1"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "expects d=512" in replies["a1"].error.message
    for key, x in (("a0", xs[0][0]), ("a2", xs[3][0])):
        response = replies[key].response
        expected_out, expected_weights = attend_alone(layer, x)
        out = np.frombuffer(response.output.data, np.float32).reshape(x.shape)
        np.testing.assert_allclose(out, expected_out, atol=1e-4, rtol=1e-4)
        assert response.HasField("attention_weights") == (key == "a2")
        assert response.timing.compute_us > 0
    weights = np.frombuffer(replies["a2"].response.attention_weights.data, np.float32)
    np.testing.assert_allclose(weights.reshape(expected_weights.shape), expected_weights, atol=1e-5)
    gateway.wait_metric("attention_requests_total", ok_before + 4, **ok)
    gateway.wait_metric("attention_requests_total", invalid_before + 2, **invalid)
    assert gateway.metric("attention_inflight_requests", api="v2_stream") == 0
    assert gateway.metric("attention_undelivered_answer_bytes") == 0


def test_a_stream_with_a_message_over_the_size_bound_ends_as_the_python_front_end_ends_it(
    model_repository: Path,
) -> None:
    """A message larger than any legal request (--max-batch-size x --max-seq-len) is not read
    into the gateway: the Python front end refuses it, and the whole call ends with its
    status."""
    flags = ("--grpc-gateway", "on", "--max-batch-size", "1", "--max-seq-len", "64")
    with (
        ServerProcess(model_repository, *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        small = _v2_stream_request(np.ones((1, 4, 512), np.float32), "small")
        large = _v2_stream_request(np.ones((1, 600, 512), np.float32), "large")
        after = _v2_stream_request(np.ones((1, 4, 512), np.float32), "after")
        with pytest.raises(grpc.RpcError) as err:
            list(
                v2grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                    iter([small, large, after]), timeout=30
                )
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        # Nothing after the refused message was read: no third request counted.
        counted = sum(
            server.metric("attention_requests_total", model="mha", api="v2_stream", code=code)
            for code in ("OK", "CANCELLED")
        )
        assert counted <= 1


def test_a_malformed_deadline_fails_only_its_own_call(gateway: ServerProcess) -> None:
    """A grpc-timeout gRPC cannot parse is answered INTERNAL, as gRPC's server answers it;
    calls after it (which the gateway hands to Python on one shared connection) still work."""
    connection = RawGrpc(gateway.grpc_port)
    try:
        stream = connection.call(
            "/inference.GRPCInferenceService/ModelMetadata", b"", metadata={"grpc-timeout": "abc"}
        )
        state = connection.wait(stream)
    finally:
        connection.close()
    assert state.headers.get("grpc-status") == str(grpc.StatusCode.INTERNAL.value[0])
    assert "grpc-timeout" in state.headers.get("grpc-message", "")
    with grpc.insecure_channel(gateway.target) as channel:
        stub = v2grpc.GRPCInferenceServiceStub(channel)
        not_plain = _v2_stream_request(np.ones((1, 4, 512), np.float32), "u", input_name="x")
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(not_plain, timeout=20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert stub.ModelMetadata(v2pb.ModelMetadataRequest(name="mha"), timeout=20).name == "mha"
        answers = list(stub.ModelStreamInfer(iter([not_plain]), timeout=20))
        assert "unexpected inference input" in answers[0].error_message


def test_its_calls_are_counted_in_metrics(
    gateway: ServerProcess, v2: triton.InferenceServerClient
) -> None:
    labels = {"model": "mha", "api": "v2", "code": "OK"}
    before = gateway.metric("attention_requests_total", **labels)
    seconds = gateway.metric("attention_request_duration_seconds_count", model="mha", api="v2")
    for _ in range(5):
        infer(v2, rng().standard_normal((1, 8, 512), dtype=np.float32))
    gateway.wait_metric("attention_requests_total", before + 5, **labels)
    assert (
        gateway.metric("attention_request_duration_seconds_count", model="mha", api="v2")
        >= seconds + 5
    )
    assert gateway.metric("attention_inflight_requests", api="v2") == 0


def test_a_deadline_that_passes_in_the_queue_is_deadline_exceeded(
    model_repository: Path,
) -> None:
    # A long queue delay holds the request in the batcher past its deadline.
    flags = ("--grpc-gateway", "on", "--max-queue-delay-ms", "2000", "--max-batch-size", "64")
    with (
        ServerProcess(model_repository, *flags) as server,
        triton.InferenceServerClient(server.target) as client,
    ):
        with pytest.raises(InferenceServerException) as err:
            infer(client, np.ones((1, 4, 512), np.float32), timeout_s=0.2)
        assert "Deadline" in str(err.value) or "DEADLINE" in err.value.status()
        server.wait_metric("attention_requests_dropped_total", 1, reason="deadline")


def test_a_killed_worker_fails_calls_at_once_and_service_returns(model_repository: Path) -> None:
    flags = ("--grpc-gateway", "on", "--max-queue-delay-ms", "3000", "--max-batch-size", "64")
    with ServerProcess(model_repository, *flags) as server:
        x = np.ones((1, 16, 512), np.float32)

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(status_of_call, server.target, x) for _ in range(8)]
            server.wait_metric("attention_queue_depth_requests", 8)
            started = time.monotonic()
            os.kill(worker_pid(server), signal.SIGKILL)
            codes = [future.result() for future in futures]
        assert time.monotonic() - started < 10, "calls waited for their deadline"
        assert codes == ["StatusCode.UNAVAILABLE"] * 8, codes
        server.wait_serving()
        with triton.InferenceServerClient(server.target) as client:
            give_up = time.monotonic() + 60
            while True:  # the gateway reconnects to the new worker on its own schedule
                try:
                    assert infer(client, x).as_numpy("output").shape == (1, 16, 512)
                    break
                except InferenceServerException:
                    assert time.monotonic() < give_up, server.log
                    time.sleep(0.05)


def test_the_gateways_kept_message_buffers_go_back_once_calls_stop(model_repository: Path) -> None:
    """Requests and answers of 1 to 8 MiB reuse buffers the gateway keeps between calls (up to
    32 MiB of them); once calls stop for an interval it hands them back with the rest of its
    free heap. Measured without the hand-back: 32-33 MiB more stayed resident."""
    x = np.full((4, 128, 512), 0.5, np.float32)  # 1 MiB each way
    request = pb.AttendRequest(
        model="mha", embeddings=pb.Tensor(shape=list(x.shape), dtype=pb.FLOAT32, data=x.tobytes())
    )
    options = [("grpc.max_receive_message_length", 16 << 20)]
    with (
        ServerProcess(
            model_repository, "--grpc-gateway", "on", "--batch-cap-budget-s", "0"
        ) as server,
        grpc.insecure_channel(server.target, options=options) as channel,
    ):
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        gateway = gateway_pids(server)[0]
        assert stub.Attend(request, timeout=60).output.shape == [4, 128, 512]
        before = settled_bytes(lambda: rss_bytes(gateway))
        for _ in range(4):
            calls = [stub.Attend.future(request, timeout=60) for _ in range(16)]
            assert {call.code() for call in calls} == {grpc.StatusCode.OK}
        busy = rss_bytes(gateway)
        after = settled_bytes(lambda: rss_bytes(gateway))
    shown = [round(nbytes / (1 << 20), 1) for nbytes in (before, busy, after)]
    assert after - before < 8 << 20, shown


def _rest_infer(server: ServerProcess, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "embeddings", "shape": list(x.shape), "datatype": "FP32"}]}
    body["inputs"][0]["data"] = x.ravel().tolist()
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/mha/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        output = json.loads(reply.read())["outputs"][0]
    return np.array(output["data"], np.float32).reshape(output["shape"])


def _grpc_answers(server: ServerProcess) -> bool:
    try:
        with triton.InferenceServerClient(server.target) as client:
            infer(client, np.ones((1, 3, 512), np.float32), timeout_s=10)
    except InferenceServerException:
        return False
    return True


def test_a_killed_gateway_is_restarted_by_its_front_end_which_serves_on(
    model_repository: Path,
) -> None:
    """A gateway that dies (SIGKILL here: the OOM killer's) is restarted on the same port by
    its front end, which keeps serving REST meanwhile: the front end is not restarted, and
    the restart is counted as the supervisor counts its own. Past --max-restarts within the
    window, the front end exits and the supervisor restarts it with a gateway of its own."""
    x = np.random.default_rng(7).standard_normal((1, 5, 512)).astype(np.float32)
    expected, _ = attend_alone(layer_for(512, 8), x)
    with ServerProcess(
        model_repository, "--grpc-gateway", "on", "--max-restarts", "1", http=True
    ) as server:
        first = gateway_pids(server)[0]
        front_end = child_pids(server)["frontend-0"]
        os.kill(first, signal.SIGKILL)
        np.testing.assert_allclose(_rest_infer(server, x), expected, rtol=1e-4, atol=1e-5)
        wait_for(lambda: len(gateway_pids(server)) >= 2, timeout_s=60, what="a new gateway")
        wait_for(lambda: _grpc_answers(server), timeout_s=60, what="gRPC served again")
        assert child_pids(server)["frontend-0"] == front_end, server.log_tail(30)
        assert server.metric("attention_process_restarts_total", process="gateway") == 1
        assert server.metric("attention_process_restarts_total", process="frontend") == 0
        # Its budget spent, the next death takes the front end with it.
        os.kill(gateway_pids(server)[1], signal.SIGKILL)
        wait_for(
            lambda: (
                child_pids(server)["frontend-0"] != front_end and len(gateway_pids(server)) >= 3
            ),
            timeout_s=60,
            what=lambda: f"the front end restarted:\n{server.log_tail(30)}",
        )
        assert "more than 1 restarts of it within 60s: giving up" in server.log
        server.wait_serving()
        assert _grpc_answers(server)
        np.testing.assert_allclose(_rest_infer(server, x), expected, rtol=1e-4, atol=1e-5)
        assert server.metric("attention_process_restarts_total", process="frontend") == 1
        assert server.terminate() == 0, server.log


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (T: stopped); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_a_stopped_gateway_is_killed_and_restarted_by_its_front_end(
    model_repository: Path,
) -> None:
    """A gateway that stops (SIGSTOP here; hung alike) sends no heartbeat: its front end
    kills it after --watchdog-timeout-s and starts another. The call it held
    ends then instead of never, and the port serves again. (It used to hold its callers, and
    new connections, for good while REST and readiness said all was well.) The held call
    ends UNAVAILABLE, or, where gRPC's client saw that the dead gateway never read it, is
    retried transparently and answered by the new one.

    Kept stopped: in some environments (a CI run started in the background, or under setsid)
    the stopped gateway was found running again moments later and answered the held call,
    so no heartbeat was ever missed; the cause is outside this server (nothing in it sends
    SIGCONT)."""
    with ServerProcess(
        model_repository, "--grpc-gateway", "on", "--watchdog-timeout-s", "2"
    ) as server:
        first = gateway_pids(server)[0]
        killing = "the gateway sent no heartbeat for 2.0s (stopped or stalled); killing it"
        resumed = 0

        def keep_stopped() -> bool:
            nonlocal resumed
            state = _process_state(first)
            if state and state != "T":
                resumed += 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(first, signal.SIGSTOP)
            return killing in server.log or not state

        with grpc.insecure_channel(server.target) as channel:
            stub = v2grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerLive(v2pb.ServerLiveRequest()).live  # connected
            os.kill(first, signal.SIGSTOP)
            try:
                wait_for(lambda: _process_state(first) == "T", what="the gateway stopped")
                resumed = 0
                held = stub.ServerReady.future(v2pb.ServerReadyRequest())  # no deadline
                wait_for(
                    keep_stopped,
                    what=lambda: (
                        f"the front end's kill of its gateway (resumed {resumed} "
                        f"times):\n{server.log_tail(30)}"
                    ),
                )
                try:
                    held.result(timeout=30)  # not a hang: a timeout fails the test
                    ended = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    ended = err.code()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(first, signal.SIGCONT)
        assert ended in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK}, ended
        assert killing in server.log, server.log_tail(30)
        wait_for(lambda: len(gateway_pids(server)) >= 2, timeout_s=60, what="a new gateway")
        server.wait_serving()
        with triton.InferenceServerClient(server.target) as client:
            assert infer(client, np.ones((1, 3, 512), np.float32)).as_numpy("output").shape == (
                1,
                3,
                512,
            )
        assert server.terminate() == 0, server.log


def test_a_gateway_hung_in_the_drain_is_killed_by_the_watchdog_and_the_server_exits_1(
    model_repository: Path,
) -> None:
    """The watchdog keeps watching in the drain: a gateway stopped there is killed after
    --watchdog-timeout-s instead of holding the stop for the whole grace period, and, its
    calls cut, the server exits 1 (as for a worker lost in the drain). Found kept stopped,
    as in the test above."""
    with ServerProcess(
        model_repository,
        "--grpc-gateway",
        "on",
        "--watchdog-timeout-s",
        "2",
        "--grace-period-s",
        "30",
    ) as server:
        gateway = gateway_pids(server)[0]
        os.kill(gateway, signal.SIGSTOP)
        wait_for(lambda: _process_state(gateway) == "T", what="the gateway stopped")
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        while server.process.poll() is None:
            assert time.monotonic() - started < 25, server.log_tail(30)
            if _process_state(gateway) not in ("T", ""):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(gateway, signal.SIGSTOP)
            time.sleep(0.05)
    assert server.process.returncode == 1, server.log_tail(30)
    assert "sent no heartbeat for 2.0s (stopped or stalled); killing it" in server.log
    assert "the gateway exited with code -9 during the drain" in server.log


def test_a_gateways_crash_output_reaches_the_log_as_its_records(model_repository: Path) -> None:
    """What Go's runtime writes to standard error (here the goroutine dump of a SIGQUIT, as
    a panic writes one) comes out as JSON records of gateway-0, like every other log line;
    the gateway's own lines, before and after its restart, too."""
    with ServerProcess(model_repository, "--grpc-gateway", "on", "--log-format", "json") as server:
        first = gateway_pids(server)[0]
        os.kill(first, signal.SIGQUIT)
        wait_for(lambda: len(gateway_pids(server)) >= 2, what="the gateway restarted")
        server.wait_serving()
        records = []
        for line in server.lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                pytest.fail(f"not a JSON log line: {line!r}")
        dump = [r for r in records if r["process"] == "gateway-0" and r["logger"] == "stderr"]
        assert dump, server.log
        assert dump[0]["message"].startswith("SIGQUIT: quit"), dump[0]
        assert all(r["level"] == "ERROR" for r in dump), dump
        assert any("goroutine" in r["message"] for r in dump), dump
        started = [r for r in records if r["process"] == "gateway-0" and r["logger"] == "gateway"]
        assert [r["message"].startswith("gateway gateway-0 started") for r in started] == [
            True,
            True,
        ], started
        with triton.InferenceServerClient(server.target) as client:
            assert infer(client, np.ones((1, 3, 512), np.float32)).as_numpy("output").shape == (
                1,
                3,
                512,
            )


def test_sigterm_finishes_accepted_calls(model_repository: Path) -> None:
    flags = ("--grpc-gateway", "on", "--max-queue-delay-ms", "500", "--max-batch-size", "64")
    server = ServerProcess(model_repository, *flags)
    with server:
        x = np.ones((1, 8, 512), np.float32)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(status_of_call, server.target, x) for _ in range(6)]
            server.wait_metric("attention_queue_depth_requests", 6)
            assert server.terminate() == 0, server.log
            codes = [future.result() for future in futures]
        assert codes == ["OK"] * 6, codes


def test_streams_read_across_the_drains_cut_answer_every_request_they_read(
    model_repository: Path,
) -> None:
    """Streams that send a message the gateway answers and one it hands to the Python front
    end just as the drain stops taking work: whatever the gateway read it answers, so
    "every request read from this stream was answered" holds (its DEBUG end line counts what
    it read). Before: Python refused the gateway's part of the stream as a new stream, which
    ended the whole call and lost what the gateway had read (5 of 7 streams in one run)."""
    not_serving_s = 0.5
    flags = ("--grpc-gateway", "on", "--shutdown-not-serving-s", str(not_serving_s))
    env = {"ATTENTION_LOG_LEVEL": "DEBUG", "ATTENTION_LOG_FORMAT": "json"}
    good = rng(1).standard_normal((2, 64, 512), dtype=np.float32)
    bad = np.ones((1, 8, 7), np.float32)  # a d the model does not take: Python answers it
    offsets_s = [-0.03, -0.01, -0.005, -0.002, 0.0, 0.002, 0.005, 0.01, 0.02, 0.03]
    ended: dict[str, tuple[str, str, int]] = {}
    done = threading.Event()
    server = ServerProcess(model_repository, *flags, env=env)
    with server, grpc.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        cut_at = time.monotonic() + 1.0 + not_serving_s  # the signal comes in a second

        def requests(offset_s: float) -> Iterator[pb.AttendRequest]:
            yield attend_request(good, request_id="first")
            time.sleep(max(0.0, cut_at + offset_s - time.monotonic()))  # sent at that moment
            yield attend_request(bad, request_id="handed-on")
            yield attend_request(good, request_id="answered-here")
            done.wait(30)  # never half-closed: the drain ends the stream

        def stream(trace_id: str, offset_s: float) -> None:
            metadata = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-00"),)
            answered = 0
            try:
                for _ in stub.AttendStream(requests(offset_s), timeout=30, metadata=metadata):
                    answered += 1
                ended[trace_id] = ("OK", "", answered)
            except grpc.RpcError as err:
                ended[trace_id] = (err.code().name, err.details(), answered)

        trace_ids = [f"{index + 1:032x}" for index in range(len(offsets_s))]
        with ThreadPoolExecutor(len(offsets_s)) as pool:
            for trace_id, offset_s in zip(trace_ids, offsets_s, strict=True):
                pool.submit(stream, trace_id, offset_s)
            time.sleep(max(0.0, cut_at - not_serving_s - time.monotonic()))
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(30) == 0, server.log
            done.set()
        records = [json.loads(line) for line in server.lines if line.startswith("{")]
    read = {
        record["trace_id"]: int(re.search(r"(\d+) requests? read", record["message"])[1])
        for record in records
        if "AttendStream ended" in record["message"] and "trace_id" in record
    }
    assert sorted(ended) == sorted(trace_ids), ended
    for trace_id, (code, details, answered) in ended.items():
        assert code == "UNAVAILABLE", (trace_id, code, details)
        assert answered == read[trace_id], (trace_id, answered, read[trace_id], details)


def test_connections_past_their_age_are_sent_away_gracefully(model_repository: Path) -> None:
    """--max-connection-age-s: a call on an old connection still gets its answer, and the
    connection gets a GOAWAY (NO_ERROR), so clients reconnect and spread over the pods."""
    flags = ("--grpc-gateway", "on", "--max-connection-age-s", "0.5")
    with ServerProcess(model_repository, *flags) as server:
        goaway = _call_until_goaway(server.grpc_port, give_up_s=30)
        assert goaway.error_code == 0, goaway  # NO_ERROR: graceful


def _call_until_goaway(port: int, give_up_s: float) -> h2.events.ConnectionTerminated:
    """Paced ServerLive calls on one connection until the server sends GOAWAY."""
    connection = RawGrpc(port)
    give_up = time.monotonic() + give_up_s
    try:
        while connection.goaway is None and time.monotonic() < give_up:
            assert not connection.closed.is_set(), f"ended without a GOAWAY: {connection.ended_by}"
            stream = connection.open("/inference.GRPCInferenceService/ServerLive", b"\0" * 5)
            with contextlib.suppress(ConnectionError):  # the GOAWAY came before its answer
                connection.wait(stream, give_up_s)
            time.sleep(0.05)  # paced calls, until the age passes
    finally:
        connection.close()
    assert connection.goaway is not None, "no GOAWAY within the time given"
    return connection.goaway


def test_the_gateway_serves_the_port_when_inference_keys_are_checked(
    model_repository: Path,
) -> None:
    """It checks them itself (tests/frontend/test_restricted_api.py compares its refusals with
    Python's)."""
    flags = ("--grpc-gateway", "on", "--restricted-api", "inference:x-infer-key=s3cret")
    with ServerProcess(model_repository, *flags) as server:
        assert gateway_pids(server), server.log
        assert "Python serves the gRPC port" not in server.log
        with triton.InferenceServerClient(server.target) as client:
            with pytest.raises(InferenceServerException) as denied:
                infer(client, np.ones((1, 2, 512), np.float32))
            assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
            tensor = triton.InferInput("embeddings", [1, 2, 512], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 2, 512), np.float32))
            result = client.infer("mha", [tensor], headers={"x-infer-key": "s3cret"})
            assert result.as_numpy("output").shape == (1, 2, 512)


def test_the_python_front_end_sees_the_clients_address(gateway: ServerProcess) -> None:
    """Behind the gateway, per-connection bounds and log lines name the client, not the
    gateway's socket; a client cannot name itself."""
    with (
        triton.InferenceServerClient(gateway.target) as client,
        pytest.raises(InferenceServerException) as refused,  # logged, and refused, by Python
    ):
        client.load_model("mha", headers={"x-attention-gateway-peer": "ipv4:6.6.6.6:1"})
    assert refused.value.status() == "StatusCode.FAILED_PRECONDITION"  # --model-control-mode
    assert "RepositoryModelLoad 'mha' asked by peer 'ipv4:127.0.0.1:" in gateway.log
    assert "6.6.6.6" not in gateway.log


def test_a_killed_front_end_leaves_no_calls_counted_in_flight(model_repository: Path) -> None:
    """SIGKILL of a front end takes its gateway down too (calls in flight on it end); the
    gateway's in-flight gauge must not keep counting them after the restart."""
    flags = ("--grpc-gateway", "on", "--max-queue-delay-ms", "3000", "--max-batch-size", "64")
    with ServerProcess(model_repository, *flags) as server:
        x = np.ones((1, 8, 512), np.float32)

        def call(_: int) -> None:
            with (
                triton.InferenceServerClient(server.target) as client,
                pytest.raises(InferenceServerException),
            ):
                infer(client, x, timeout_s=30)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            server.wait_metric("attention_inflight_requests", 6, api="v2")
            front_end = child_pids(server)["frontend-0"]
            os.kill(front_end, signal.SIGKILL)
            for future in futures:
                future.result()
        give_up = time.monotonic() + 60
        while child_pids(server)["frontend-0"] == front_end:
            assert time.monotonic() < give_up, server.log
            time.sleep(0.05)
        server.wait_serving()
        with triton.InferenceServerClient(server.target) as client:
            while True:  # the new gateway has started once a call is answered
                try:
                    infer(client, x)
                    break
                except InferenceServerException:
                    assert time.monotonic() < give_up, server.log
                    time.sleep(0.05)
        assert server.metric("attention_inflight_requests", api="v2") == 0
