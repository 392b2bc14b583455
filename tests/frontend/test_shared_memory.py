"""Triton's system shared-memory extension, driven by tritonclient's own helpers against the real
server (gRPC and HTTP/REST): exact against torch, every bad reference refused with its code."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from bench.harness import wait_for
from export.pipeline import ExportRequest, run_export
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from service.settings import Settings, load_settings
from tests.harness.h2_raw import RawGrpc
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import ServerProcess

# Every server here runs with the gRPC gateway, then without it (the module's server
# fixtures take grpc_gateway; tests that start their own servers get it from this mark).
pytestmark = pytest.mark.usefixtures("grpc_gateway")

D, H, N, SEQ = 64, 4, 2, 8
IN_BYTES = N * SEQ * D * 4
WEIGHTS_BYTES = N * H * SEQ * SEQ * 4
MAX_REGIONS = 6
PREFIX = f"attn-test-{os.getpid()}"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shm-models")
    run_export(ExportRequest(name="small", embed_dim=D, num_heads=H, out=root))
    return root


@pytest.fixture(scope="module")
def shm_server(repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    flags = (
        "--default-model",
        "small",
        "--client-shared-memory",
        "on",
        "--max-client-shared-memory-regions",
        str(MAX_REGIONS),
    )
    with ServerProcess(repository, *flags, http=True) as process:
        yield process


@pytest.fixture(scope="module")
def reference():
    return layer_for(D, H)


class Objects:
    """Shared-memory objects made by a test, destroyed after it (none may be left behind)."""

    def __init__(self) -> None:
        self.handles: list[shm.SharedMemoryRegion] = []

    def make(self, name: str, byte_size: int) -> tuple[shm.SharedMemoryRegion, str]:
        key = f"/{PREFIX}-{name}"
        handle = shm.create_shared_memory_region(name, key, byte_size, create_only=True)
        self.handles.append(handle)
        return handle, key

    def destroy(self, handle: shm.SharedMemoryRegion) -> None:
        self.handles.remove(handle)
        shm.destroy_shared_memory_region(handle)


@pytest.fixture
def objects(shm_server: ServerProcess) -> Iterator[Objects]:
    made = Objects()
    yield made
    with triton.InferenceServerClient(shm_server.target) as client:
        client.unregister_system_shared_memory()
    for handle in list(made.handles):
        made.destroy(handle)
    assert not list(Path("/dev/shm").glob(f"{PREFIX}-*"))


def _code(call) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return f"{caught.value.status()} {caught.value.message()}"


def _shm_input(nbytes: int = IN_BYTES, offset: int = 0, region: str = "in") -> triton.InferInput:
    tensor = triton.InferInput("embeddings", [N, SEQ, D], "FP32")
    tensor.set_shared_memory(region, nbytes, offset)
    return tensor


def _shm_output(name: str, region: str, nbytes: int, offset: int = 0):
    output = triton.InferRequestedOutput(name)
    output.set_shared_memory(region, nbytes, offset)
    return output


def test_grpc_inputs_and_outputs_in_shared_memory_equal_torch(
    shm_server: ServerProcess, objects: Objects, reference
) -> None:
    x = np.random.default_rng(0).standard_normal((N, SEQ, D), dtype=np.float32)
    inputs, key_in = objects.make("in", IN_BYTES + 128)
    outputs, key_out = objects.make("out", 256 + IN_BYTES + WEIGHTS_BYTES)
    shm.set_shared_memory_region(inputs, [x], offset=128)
    with triton.InferenceServerClient(shm_server.target) as client:
        assert "system_shared_memory" in client.get_server_metadata(as_json=True)["extensions"]
        client.register_system_shared_memory("in", key_in, IN_BYTES + 128)
        client.register_system_shared_memory("out", key_out, IN_BYTES + WEIGHTS_BYTES, offset=256)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["out"] == {
            "name": "out",
            "key": key_out,
            "offset": "256",
            "byte_size": str(IN_BYTES + WEIGHTS_BYTES),
        }
        result = client.infer(
            "small",
            [_shm_input(offset=128)],
            outputs=[
                _shm_output("output", "out", IN_BYTES),
                _shm_output("attention_weights", "out", WEIGHTS_BYTES, offset=IN_BYTES),
            ],
        )
    response = result.get_response()
    assert [bytes(raw) for raw in response.raw_output_contents] == [b"", b""]
    assert response.outputs[1].parameters["shared_memory_offset"].int64_param == IN_BYTES
    assert list(response.outputs[0].shape) == [N, SEQ, D]
    want_output, want_weights = attend_alone(reference, x)
    got_output = shm.get_contents_as_numpy(outputs, np.float32, [N, SEQ, D], offset=256)
    got_weights = shm.get_contents_as_numpy(
        outputs, np.float32, [N, H, SEQ, SEQ], offset=256 + IN_BYTES
    )
    np.testing.assert_allclose(got_output, want_output, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_weights, want_weights, atol=1e-6, rtol=0)
    del got_output, got_weights  # views of the mapping, which destroy() closes


def test_a_large_input_in_shared_memory_equals_torch(
    shm_server: ServerProcess, objects: Objects, reference
) -> None:
    """Inputs past the size the worker reads on its loop go through its reader thread."""
    shape = (4, 300, D)  # 300 KiB: read on the worker's reader thread
    x = np.random.default_rng(9).standard_normal(shape, dtype=np.float32)
    handle, key = objects.make("large", x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    tensor = triton.InferInput("embeddings", list(shape), "FP32")
    tensor.set_shared_memory("large", x.nbytes)
    with triton.InferenceServerClient(shm_server.target) as client:
        client.register_system_shared_memory("large", key, x.nbytes)
        got = client.infer("small", [tensor]).as_numpy("output")
    np.testing.assert_allclose(got, attend_alone(reference, x)[0], atol=1e-5, rtol=0)


def test_http_shared_memory_and_mixed_outputs_equal_torch(
    shm_server: ServerProcess, objects: Objects, reference
) -> None:
    x = np.random.default_rng(1).standard_normal((N, SEQ, D), dtype=np.float32)
    inputs, key_in = objects.make("in", IN_BYTES)
    outputs, key_out = objects.make("out", IN_BYTES)
    shm.set_shared_memory_region(inputs, [x])
    client = triton_http.InferenceServerClient(shm_server.http_url)
    try:
        client.register_system_shared_memory("in", key_in, IN_BYTES)
        client.register_system_shared_memory("out", key_out, IN_BYTES)
        status = client.get_system_shared_memory_status("in")
        assert status == [{"name": "in", "key": key_in, "offset": 0, "byte_size": IN_BYTES}]
        tensor = triton_http.InferInput("embeddings", [N, SEQ, D], "FP32")
        tensor.set_shared_memory("in", IN_BYTES)
        output = triton_http.InferRequestedOutput("output", binary_data=True)
        output.set_shared_memory("out", IN_BYTES)
        weights = triton_http.InferRequestedOutput("attention_weights", binary_data=True)
        result = client.infer("small", [tensor], outputs=[output, weights])
        assert result.get_output("output")["parameters"]["shared_memory_region"] == "out"
        client.unregister_system_shared_memory("in")
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
    finally:
        client.close()
    want_output, want_weights = attend_alone(reference, x)
    got = shm.get_contents_as_numpy(outputs, np.float32, [N, SEQ, D])
    np.testing.assert_allclose(got, want_output, atol=1e-5, rtol=0)
    np.testing.assert_allclose(result.as_numpy("attention_weights"), want_weights, atol=1e-6)
    del got


def test_attend_request_region_references_equal_torch(
    shm_server: ServerProcess, objects: Objects, reference
) -> None:
    x = np.random.default_rng(3).standard_normal((N, SEQ, D), dtype=np.float32)
    memory, key = objects.make("all", 2 * IN_BYTES + WEIGHTS_BYTES)
    shm.set_shared_memory_region(memory, [x])
    with triton.InferenceServerClient(shm_server.target) as client:
        client.register_system_shared_memory("all", key, 2 * IN_BYTES + WEIGHTS_BYTES)
    with grpc.insecure_channel(shm_server.target) as channel:
        attend = attention_pb2_grpc.AttentionServiceStub(channel).Attend
        request = pb.AttendRequest(
            embeddings=pb.Tensor(shape=[N, SEQ, D], dtype=pb.FLOAT32),
            embeddings_region=pb.SharedMemoryRef(region="all", byte_size=IN_BYTES),
            output_region=pb.SharedMemoryRef(region="all", offset=IN_BYTES, byte_size=IN_BYTES),
            attention_weights_region=pb.SharedMemoryRef(
                region="all", offset=2 * IN_BYTES, byte_size=WEIGHTS_BYTES
            ),
            return_attention_weights=True,
        )
        response = attend(request)
        assert list(response.output.shape) == [N, SEQ, D]
        assert not response.output.data
        assert not response.attention_weights.data
        request.embeddings_region.region = "nope"
        with pytest.raises(grpc.RpcError) as caught:
            attend(request)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    want_output, want_weights = attend_alone(reference, x)
    got_output = shm.get_contents_as_numpy(memory, np.float32, [N, SEQ, D], offset=IN_BYTES)
    got_weights = shm.get_contents_as_numpy(
        memory, np.float32, [N, H, SEQ, SEQ], offset=2 * IN_BYTES
    )
    np.testing.assert_allclose(got_output, want_output, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_weights, want_weights, atol=1e-6, rtol=0)
    del got_output, got_weights


def test_bad_references_are_refused_with_clear_codes(
    shm_server: ServerProcess, objects: Objects
) -> None:
    x = np.ones((N, SEQ, D), dtype=np.float32)
    inputs, key_in = objects.make("in", IN_BYTES)
    shm.set_shared_memory_region(inputs, [x])
    with triton.InferenceServerClient(shm_server.target) as client:
        client.register_system_shared_memory("in", key_in, IN_BYTES)

        def infer(tensor=None, outputs=None):
            return lambda: client.infer("small", [tensor or _shm_input()], outputs=outputs)

        assert _code(infer(_shm_input(region="nope"))).startswith("StatusCode.NOT_FOUND")
        out_of_bounds = _code(infer(_shm_input(offset=64)))
        assert out_of_bounds.startswith("StatusCode.INVALID_ARGUMENT")
        assert "past the end of shared-memory region 'in'" in out_of_bounds
        wrong_size = _code(infer(_shm_input(nbytes=IN_BYTES - 4)))
        assert f"needs {IN_BYTES} bytes" in wrong_size, wrong_size
        small = _code(infer(outputs=[_shm_output("output", "in", IN_BYTES - 4)]))
        assert small.startswith("StatusCode.INVALID_ARGUMENT")
        assert f"needs {IN_BYTES} bytes" in small
        unknown_output = _code(infer(outputs=[_shm_output("output", "gone", 16)]))
        assert unknown_output.startswith("StatusCode.NOT_FOUND")
        shm.set_shared_memory_region(inputs, [np.full_like(x, np.nan)])  # read by the worker
        not_finite = _code(infer())
        assert not_finite.startswith("StatusCode.INVALID_ARGUMENT")
        assert f"{x.size} non-finite values" in not_finite
        shm.set_shared_memory_region(inputs, [x])

        def register(name: str, key: str, size: int = 64, offset: int = 0):
            return lambda: client.register_system_shared_memory(name, key, size, offset)

        for key in ("../etc/passwd", "a/b", "", "//x", "..", "x\0y", "k" * 300):
            assert _code(register("bad", key)).startswith("StatusCode.INVALID_ARGUMENT"), key
        assert "no object" in _code(register("bad", f"/{PREFIX}-absent"))
        assert "past the end" in _code(register("bad", key_in, IN_BYTES, offset=4))
        assert _code(register("in", key_in)).startswith("StatusCode.ALREADY_EXISTS")
        link = Path(f"/dev/shm/{PREFIX}-link")
        link.symlink_to(f"/dev/shm/{key_in[1:]}")
        try:
            assert "cannot open" in _code(register("bad", link.name))  # O_NOFOLLOW
        finally:
            link.unlink()
        for index in range(MAX_REGIONS - 1):
            client.register_system_shared_memory(f"r{index}", key_in, 64)
        assert _code(register("one-more", key_in)).startswith("StatusCode.RESOURCE_EXHAUSTED")
        assert _code(lambda: client.get_system_shared_memory_status("nope")).startswith(
            "StatusCode.NOT_FOUND"
        )
        client.unregister_system_shared_memory("nope")  # nothing to do, as Triton


@pytest.mark.gateway_off_heavy
def test_region_gone_while_waiting_fails_that_request_alone(repository: Path, reference) -> None:
    """Requests queue for --max-queue-delay-ms; meanwhile one's output region is unregistered
    and another's object is removed: those two fail NOT_FOUND, the one batched with them is
    answered."""
    made = Objects()
    flags = (
        "--default-model",
        "small",
        "--client-shared-memory",
        "on",
        "--max-queue-delay-ms",
        "3000",
        "--max-batch-size",
        "8",
    )
    x = np.random.default_rng(2).standard_normal((N, SEQ, D), dtype=np.float32)
    try:
        with ServerProcess(repository, *flags) as server:
            client = triton.InferenceServerClient(server.target)
            for name in ("a", "b"):
                _, key = made.make(name, IN_BYTES)
                client.register_system_shared_memory(name, key, IN_BYTES)
            results: dict[str, object] = {}
            done = threading.Event()

            def callback(name: str):
                def record(result, error) -> None:
                    results[name] = error or result
                    if len(results) == 3:
                        done.set()

                return record

            plain = triton.InferInput("embeddings", [N, SEQ, D], "FP32").set_data_from_numpy(x)
            for name in ("a", "b"):
                output = [_shm_output("output", name, IN_BYTES)]
                client.async_infer("small", [plain], callback(name), outputs=output)
            client.async_infer("small", [plain], callback("plain"))
            server.wait_metric("attention_queue_depth_requests", 3)
            client.unregister_system_shared_memory("a")
            made.destroy(made.handles[1])  # b's object removed while it is registered
            assert done.wait(60)
            client.close()
    finally:
        for handle in list(made.handles):
            made.destroy(handle)
    assert isinstance(results["a"], InferenceServerException)
    assert results["a"].status() == "StatusCode.NOT_FOUND"
    assert "unregistered" in results["a"].message()
    assert isinstance(results["b"], InferenceServerException)
    assert "removed or shrunk" in results["b"].message()
    want, _ = attend_alone(reference, x)
    np.testing.assert_allclose(results["plain"].as_numpy("output"), want, atol=1e-5, rtol=0)
    assert not list(Path("/dev/shm").glob(f"{PREFIX}-*"))


def test_a_region_descriptor_is_closed_once_whatever_the_order(tmp_path: Path) -> None:
    """A request holding a region when it is unregistered: stop_writes (on a thread), the
    request's release (on the loop), then close: the descriptor is closed by exactly one of
    them, so a number reused meanwhile by another open file is left alone."""
    from service.worker.client_regions import ClientRegion

    path = tmp_path / "object"
    path.write_bytes(bytes(64))
    region = ClientRegion("r", "/k", 0, 64, os.open(path, os.O_RDWR))
    region.retain()  # a request in flight
    region.stop_writes()  # unregister, on its thread
    region.release()  # the request ends on the loop before unregister's close()
    region.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(region.fd)  # closed
    reused = os.open(path, os.O_RDONLY)  # likely the same number
    try:
        region.close()  # a second unregister of the same region closes nothing
        os.fstat(reused)
    finally:
        os.close(reused)


def test_two_clients_cycling_regions_never_disturb_each_other(repository: Path, reference) -> None:
    """Two clients register, infer in and unregister their own regions concurrently, one of
    them unregistering its output region while its request is in flight: every unregister is
    answered OK, every answer of the other client equals torch, and no descriptor is closed
    twice (no EBADF in the log)."""
    made = Objects()
    flags = (
        "--default-model",
        "small",
        "--client-shared-memory",
        "on",
        "--max-queue-delay-ms",
        "1",
        "--max-batch-size",
        "8",
    )
    x = np.random.default_rng(11).standard_normal((N, SEQ, D), dtype=np.float32)
    want, _ = attend_alone(reference, x)
    cycles, give_up = 60, time.monotonic() + 90
    errors: list[str] = []
    try:
        with ServerProcess(repository, *flags) as server:
            handles = {}
            for name in ("racer", "steady"):
                handle, key = made.make(name, 2 * IN_BYTES)
                shm.set_shared_memory_region(handle, [x])
                handles[name] = key

            def cycle(name: str, unregister_in_flight: bool) -> None:
                with grpc.insecure_channel(server.target) as channel:
                    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                    for _ in range(cycles):
                        if time.monotonic() > give_up:
                            return
                        stub.SystemSharedMemoryRegister(
                            v2.SystemSharedMemoryRegisterRequest(
                                name=name, key=handles[name], byte_size=2 * IN_BYTES
                            ),
                            timeout=30,
                        )
                        call = stub.ModelInfer.future(_v2_request(name, IN_BYTES), timeout=30)
                        if unregister_in_flight:
                            stub.SystemSharedMemoryUnregister(
                                v2.SystemSharedMemoryUnregisterRequest(name=name), timeout=30
                            )
                        try:
                            call.result()
                        except grpc.RpcError as err:
                            if not unregister_in_flight or err.code() != grpc.StatusCode.NOT_FOUND:
                                errors.append(f"{name}: {err.code()} {err.details()}")
                        stub.SystemSharedMemoryUnregister(
                            v2.SystemSharedMemoryUnregisterRequest(name=name), timeout=30
                        )

            racer = threading.Thread(target=cycle, args=("racer", True))
            racer.start()
            try:
                with grpc.insecure_channel(server.target) as channel:
                    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                    steady = made.handles[1]
                    for _ in range(cycles):
                        stub.SystemSharedMemoryRegister(
                            v2.SystemSharedMemoryRegisterRequest(
                                name="steady", key=handles["steady"], byte_size=2 * IN_BYTES
                            ),
                            timeout=30,
                        )
                        shm.set_shared_memory_region(steady, [np.zeros_like(x)], offset=IN_BYTES)
                        stub.ModelInfer(_v2_request("steady", IN_BYTES), timeout=30)
                        got = shm.get_contents_as_numpy(
                            steady, np.float32, [N, SEQ, D], offset=IN_BYTES
                        )
                        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
                        del got
                        stub.SystemSharedMemoryUnregister(
                            v2.SystemSharedMemoryUnregisterRequest(name="steady"), timeout=30
                        )
            finally:
                racer.join(120)
            assert server.process.poll() is None
            log = server.log  # while serving: no child has exited
    finally:
        for handle in list(made.handles):
            made.destroy(handle)
    assert errors == []
    assert "Bad file descriptor" not in log
    assert "exited" not in log


def test_off_by_default(repository: Path) -> None:
    assert load_settings([]).client_shared_memory == "off"
    with ServerProcess(repository, "--default-model", "small", http=True) as server:
        with triton.InferenceServerClient(server.target) as client:
            refused = _code(lambda: client.register_system_shared_memory("r", "/k", 64))
            assert refused.startswith("StatusCode.UNIMPLEMENTED")
            assert "--client-shared-memory on" in refused
            assert "system_shared_memory" not in client.get_server_metadata().extensions
            refused = _code(lambda: client.infer("small", [_shm_input(region="r")]))
            assert refused.startswith("StatusCode.INVALID_ARGUMENT")
            assert "--client-shared-memory on" in refused
        with grpc.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            # A region alone, no embeddings tensor: that the feature is off is the news (it
            # was "embeddings is missing").
            ref = pb.SharedMemoryRef(region="r", byte_size=8192)
            for request in (
                pb.AttendRequest(embeddings_region=ref),
                pb.AttendRequest(output_region=ref),
            ):
                with pytest.raises(grpc.RpcError) as refused_call:
                    stub.Attend(request, timeout=30)
                assert refused_call.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "--client-shared-memory on" in (refused_call.value.details() or "")
        rest = triton_http.InferenceServerClient(server.http_url)
        try:
            assert _code(rest.get_system_shared_memory_status).startswith("501")
        finally:
            rest.close()


def test_cuda_shared_memory_calls_are_unimplemented_on_both_apis(repository: Path) -> None:
    """Triton's CUDA extension is not served: UNIMPLEMENTED over gRPC, 501 with the JSON
    error over REST (its paths used to answer 404, "no endpoint")."""
    flags = ("--default-model", "small", "--client-shared-memory", "on")
    with ServerProcess(repository, *flags, http=True) as server:
        with triton.InferenceServerClient(server.target) as client:
            assert _code(client.get_cuda_shared_memory_status).startswith(
                "StatusCode.UNIMPLEMENTED"
            )
        rest = triton_http.InferenceServerClient(server.http_url)
        try:
            for call in (
                rest.get_cuda_shared_memory_status,
                lambda: rest.get_cuda_shared_memory_status("r"),
                lambda: rest.register_cuda_shared_memory("r", b"handle", 0, 64),
                lambda: rest.unregister_cuda_shared_memory("r"),
                rest.unregister_cuda_shared_memory,
            ):
                refused = _code(call)
                assert refused.startswith("501"), refused
                assert "CUDA shared memory is not supported by this server" in refused
        finally:
            rest.close()


def _v2_request(region: str, nbytes: int) -> v2.ModelInferRequest:
    """ModelInfer with the input at the start of region and the output right after it."""
    request = v2.ModelInferRequest(model_name="small")
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=[N, SEQ, D])
    output = request.outputs.add(name="output")
    for parameters, offset in ((tensor.parameters, 0), (output.parameters, nbytes)):
        parameters["shared_memory_region"].string_param = region
        parameters["shared_memory_offset"].int64_param = offset
        parameters["shared_memory_byte_size"].int64_param = nbytes
    return request


def test_every_front_end_serves_a_region_registered_through_one(
    repository: Path, reference
) -> None:
    """With two front ends, a region registered on one connection is used on sixteen new
    connections (the kernel spreads them over both front ends); unregistered on one, it is
    gone on all. A client that shrinks its object fails its own request, not the server."""
    made = Objects()
    x = np.random.default_rng(5).standard_normal((N, SEQ, D), dtype=np.float32)
    flags = ("--default-model", "small", "--client-shared-memory", "on", "--frontends", "2")
    fresh = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own per channel
    try:
        with ServerProcess(repository, *flags) as server:
            handle, key = made.make("both", 2 * IN_BYTES)
            shm.set_shared_memory_region(handle, [x])
            with triton.InferenceServerClient(server.target) as client:
                client.register_system_shared_memory("both", key, 2 * IN_BYTES)
            want, _ = attend_alone(reference, x)
            for _ in range(16):
                with grpc.insecure_channel(server.target, options=fresh) as channel:
                    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                    status = stub.SystemSharedMemoryStatus(
                        v2.SystemSharedMemoryStatusRequest(name="both"), timeout=30
                    )
                    assert status.regions["both"].key == key
                    shm.set_shared_memory_region(handle, [np.zeros_like(x)], offset=IN_BYTES)
                    stub.ModelInfer(_v2_request("both", IN_BYTES), timeout=30)
                    got = shm.get_contents_as_numpy(
                        handle, np.float32, [N, SEQ, D], offset=IN_BYTES
                    )
                    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
                    del got
            with open(Path("/dev/shm") / key.lstrip("/"), "r+b") as shrunk:
                shrunk.truncate(IN_BYTES // 2)  # the input's second half is gone
            with grpc.insecure_channel(server.target, options=fresh) as channel:
                stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ModelInfer(_v2_request("both", IN_BYTES), timeout=30)
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
                assert "removed or shrunk" in caught.value.details()
                stub.SystemSharedMemoryUnregister(
                    v2.SystemSharedMemoryUnregisterRequest(name="both"), timeout=30
                )
            for _ in range(4):
                with grpc.insecure_channel(server.target, options=fresh) as channel:
                    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                    with pytest.raises(grpc.RpcError) as caught:
                        stub.SystemSharedMemoryStatus(
                            v2.SystemSharedMemoryStatusRequest(name="both"), timeout=30
                        )
                    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert server.process.poll() is None
            assert "exited" not in server.log  # neither a front end nor the worker died
    finally:
        for handle in list(made.handles):
            made.destroy(handle)


def test_an_input_in_shared_memory_still_counts_its_answer_against_the_budget(
    shm_server: ServerProcess, objects: Objects
) -> None:
    """A request of a few dozen bytes (its input in a region) can ask for megabytes of answer
    in the message. Twelve such calls on one connection that reads nothing: the answers are
    reserved in --max-undelivered-bytes-per-connection before they are computed, so those
    past it are refused at once instead of computed, and what is held stays within it."""
    sequences, seq = 8, 512
    nbytes = sequences * seq * D * 4
    answer = nbytes + sequences * H * seq * seq * 4  # output and weights, in the message
    calls = 12  # 12 x 2 x 33 MiB > the 512 MiB per connection
    memory, key = objects.make("big", nbytes)
    shm.set_shared_memory_region(memory, [np.ones((sequences, seq, D), np.float32)])
    with triton.InferenceServerClient(shm_server.target) as client:
        client.register_system_shared_memory("big", key, nbytes)
    request = pb.AttendRequest(
        embeddings=pb.Tensor(shape=[sequences, seq, D], dtype=pb.FLOAT32),
        embeddings_region=pb.SharedMemoryRef(region="big", byte_size=nbytes),
        return_attention_weights=True,
    ).SerializeToString()
    assert len(request) < 100
    computed = shm_server.metric("attention_batch_size_sequences_sum")
    refused = shm_server.metric("attention_requests_total", code="RESOURCE_EXHAUSTED")

    def settled() -> tuple[float, float]:
        held = (shm_server.metric("attention_batch_size_sequences_sum") - computed) / sequences
        gone = shm_server.metric("attention_requests_total", code="RESOURCE_EXHAUSTED") - refused
        return held, gone

    slow = RawGrpc(shm_server.grpc_port, window=1, read=False)  # reads nothing of the answers
    try:
        for _ in range(calls):
            slow.call("/attention.v1.AttentionService/Attend", request)
        give_up = time.monotonic() + 120
        while sum(settled()) < calls:
            assert time.monotonic() < give_up, f"calls neither computed nor refused: {settled()}"
            time.sleep(0.05)
        _, gone = settled()
        assert gone > 0, "every call was computed: their answers were not counted"
        per_connection = Settings.max_undelivered_bytes_per_connection
        assert answer <= shm_server.metric("attention_undelivered_answer_bytes") <= per_connection
    finally:
        slow.close()
    wait_for(
        lambda: shm_server.metric("attention_undelivered_answer_bytes") == 0,
        what="the budget given back",
        timeout_s=30,
    )


def test_rest_answers_nobody_reads_stay_within_the_budget(
    shm_server: ServerProcess, objects: Objects
) -> None:
    """The same over HTTP/REST: 24 connections each send a 400-byte request for a 33 MiB
    answer and read nothing. Answers are held in --max-undelivered-bytes until written, so
    the calls past it are refused at once (429) and what is held stays within it."""
    sequences, seq = 8, 512
    nbytes = sequences * seq * D * 4
    memory, key = objects.make("rest-big", nbytes)
    shm.set_shared_memory_region(memory, [np.ones((sequences, seq, D), np.float32)])
    with triton.InferenceServerClient(shm_server.target) as client:
        client.register_system_shared_memory("rest-big", key, nbytes)
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "embeddings",
                    "datatype": "FP32",
                    "shape": [sequences, seq, D],
                    "parameters": {
                        "shared_memory_region": "rest-big",
                        "shared_memory_byte_size": nbytes,
                    },
                }
            ],
            "outputs": [
                {"name": name, "parameters": {"binary_data": True}}
                for name in ("output", "attention_weights")
            ],
        }
    ).encode()
    http = (
        f"POST /v2/models/small/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    assert len(http) < 500
    refusals = shm_server.metric("attention_undelivered_refusals_total")
    computed = shm_server.metric("attention_batch_size_sequences_sum")
    sockets = []
    try:
        for _ in range(24):
            connection = socket.create_connection(("127.0.0.1", shm_server.http_port))
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            connection.sendall(http)
            sockets.append(connection)

        def settled() -> float:
            held = (shm_server.metric("attention_batch_size_sequences_sum") - computed) / sequences
            return held + shm_server.metric("attention_undelivered_refusals_total") - refusals

        give_up = time.monotonic() + 120
        while settled() < len(sockets):
            assert time.monotonic() < give_up, "calls neither computed nor refused"
            time.sleep(0.05)
        assert shm_server.metric("attention_undelivered_refusals_total") > refusals
        assert (
            0
            < shm_server.metric("attention_undelivered_answer_bytes")
            <= Settings.max_undelivered_bytes
        )
    finally:
        for connection in sockets:
            connection.close()
    wait_for(
        lambda: shm_server.metric("attention_undelivered_answer_bytes") == 0,
        what="the budget given back",
        timeout_s=30,
    )


def _param(parameters, name: str, kind: str, value) -> None:
    cast = {"string_param": str, "double_param": float}.get(kind, int)
    setattr(parameters[name], kind, cast(value))


def _refs(parameters, region="io", offset=0, nbytes=IN_BYTES, kinds=("int64_param",) * 2):
    _param(parameters, "shared_memory_region", "string_param", region)
    if offset is not None:
        _param(parameters, "shared_memory_offset", kinds[0], offset)
    if nbytes is not None:
        _param(parameters, "shared_memory_byte_size", kinds[1], nbytes)


def _with_input_entry(message: v2.ModelInferRequest, entry: bytes) -> bytes:
    """message on the wire with entry (raw bytes of one parameters map entry, which no
    message object would write) added to its input's parameters."""
    tensor = message.inputs[0].SerializeToString() + b"\x22" + _varint(len(entry)) + entry
    rest = v2.ModelInferRequest()
    rest.CopyFrom(message)
    del rest.inputs[:]
    return rest.SerializeToString() + b"\x2a" + _varint(len(tensor)) + tensor


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _v2_cases(x: np.ndarray) -> dict[str, v2.ModelInferRequest | bytes]:
    """ModelInfer requests with tensors in region 'io' (input at 0, output after it, weights
    after that), good and bad in every way a reference can be."""

    def request(*, input_refs=True, raw=False, outputs=(("output", IN_BYTES),), **refs):
        message = v2.ModelInferRequest(model_name="small", id="shm-1")
        tensor = message.inputs.add(name="embeddings", datatype="FP32", shape=[N, SEQ, D])
        if input_refs:
            _refs(tensor.parameters, **refs)
        if raw or not input_refs:
            message.raw_input_contents.append(x.tobytes())
        for name, offset in outputs:
            output = message.outputs.add(name=name)
            if offset is not None:
                _refs(
                    output.parameters,
                    offset=offset,
                    nbytes=IN_BYTES if name == "output" else WEIGHTS_BYTES,
                )
        return message

    weights_at = 2 * IN_BYTES
    cases = {
        "input and output": request(),
        "input alone": request(outputs=()),
        "output alone": request(input_refs=False),
        "weights and output in regions": request(
            outputs=(("attention_weights", weights_at), ("output", IN_BYTES))
        ),
        "weights in the message": request(
            outputs=(("output", IN_BYTES), ("attention_weights", None))
        ),
        "uint64 counts": request(kinds=("uint64_param", "uint64_param")),
        "no offset": request(offset=None),
        "no byte size": request(nbytes=None),
        "negative offset": request(offset=-64),
        "offset as a string": request(kinds=("string_param", "int64_param")),
        "byte size as a double": request(kinds=("int64_param", "double_param")),
        "unknown region": request(region="nope"),
        "an offset inside": request(offset=64),
        "past the end": request(offset=IN_BYTES + WEIGHTS_BYTES + 64),
        "wrong size": request(nbytes=IN_BYTES - 4),
        "raw data as well": request(raw=True),
        "wrong shape": request(nbytes=IN_BYTES),
    }
    cases["wrong shape"].inputs[0].shape[:] = [N, SEQ, D + 1]
    tolerated = request()
    tolerated.inputs[0].parameters["binary_data_size"].int64_param = IN_BYTES
    tolerated.outputs[0].parameters["binary_data"].bool_param = True
    cases["tolerated parameters"] = tolerated
    unknown = request()
    unknown.outputs[0].parameters["classification"].int64_param = 3
    cases["an unknown parameter"] = unknown
    region_as_int = request()
    region_as_int.inputs[0].parameters["shared_memory_region"].int64_param = 1
    cases["region as an integer"] = region_as_int
    small_output = request()
    small_output.outputs[0].parameters["shared_memory_byte_size"].int64_param = IN_BYTES - 4
    cases["output region too small"] = small_output
    long_name = request(region="r" * 300)  # no region can have it (registration refuses it)
    long_name.outputs[0].parameters["shared_memory_region"].string_param = "r" * 300
    cases["a name longer than any region's"] = long_name
    # A field of the wrong wire type is an unknown field to protobuf: it changes nothing.
    region_and_varint = v2.InferParameter()
    region_and_varint.MergeFromString(b"\x1a\x02io" + b"\x18\x01")  # string 'io', varint 3
    odd_wire = request()
    odd_wire.inputs[0].parameters["shared_memory_region"].CopyFrom(region_and_varint)
    cases["a string parameter's field also as a varint"] = odd_wire
    # Protobuf refuses a string that is not UTF-8 (the whole request), and keeps a map entry
    # with a field besides key and value out of the map.
    key = b"\x0a\x10binary_data_size"
    cases["a tolerated parameter not UTF-8"] = _with_input_entry(
        request(), key + b"\x12\x03\x1a\x01\xff"
    )
    size = b"\x10" + _varint(IN_BYTES)  # int64_param
    sized = b"\x0a\x17shared_memory_byte_size\x12" + _varint(len(size)) + size
    cases["a map entry with a third field"] = _with_input_entry(
        request(nbytes=None), sized + b"\x18\x01"
    )
    cases["a map entry of two fields (control)"] = _with_input_entry(request(nbytes=None), sized)
    return cases


def _attend_cases() -> dict[str, pb.AttendRequest | bytes]:
    def request(**fields) -> pb.AttendRequest:
        message = pb.AttendRequest(
            model="small",
            request_id="attend-shm",
            embeddings=pb.Tensor(shape=[N, SEQ, D], dtype=pb.FLOAT32),
            embeddings_region=pb.SharedMemoryRef(region="io", byte_size=IN_BYTES),
            output_region=pb.SharedMemoryRef(region="io", offset=IN_BYTES, byte_size=IN_BYTES),
        )
        for name, value in fields.items():
            if value is None:
                message.ClearField(name)
            elif isinstance(value, pb.SharedMemoryRef | pb.Tensor):
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    weights = pb.SharedMemoryRef(region="io", offset=2 * IN_BYTES, byte_size=WEIGHTS_BYTES)
    flat = request(
        embeddings=pb.Tensor(shape=[SEQ, D], dtype=pb.FLOAT32),
        embeddings_region=pb.SharedMemoryRef(region="io", byte_size=SEQ * D * 4),
        output_region=pb.SharedMemoryRef(region="io", offset=IN_BYTES, byte_size=SEQ * D * 4),
    )
    with_data = request()
    with_data.embeddings.data = b"\0" * IN_BYTES
    # A message field given twice is merged: the second output_region keeps the first's offset.
    twice = (
        request().SerializeToString()
        + pb.AttendRequest(
            output_region=pb.SharedMemoryRef(region="io", byte_size=IN_BYTES)
        ).SerializeToString()
    )
    return {
        "attend output region given twice": twice,
        "attend in and out": request(),
        "attend with weights in a region": request(
            return_attention_weights=True, attention_weights_region=weights
        ),
        "attend weights region without weights": request(attention_weights_region=weights),
        "attend output in the message": request(output_region=None),
        "attend [seq, d]": flat,
        "attend unknown region": request(
            embeddings_region=pb.SharedMemoryRef(region="nope", byte_size=IN_BYTES)
        ),
        "attend wrong size": request(
            embeddings_region=pb.SharedMemoryRef(region="io", byte_size=IN_BYTES + 4)
        ),
        "attend data as well": with_data,
    }


def _serialized(message: pb.AttendRequest | v2.ModelInferRequest | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _outcome(call, request, region: shm.SharedMemoryRegion, size: int):
    """What one call gave: its status and message, or its answer (timing left out) and the
    region's bytes after it."""
    shm.set_shared_memory_region(region, [np.zeros(size, np.uint8)])  # no stale answer
    shm.set_shared_memory_region(region, [_X])
    try:
        response = call(request, timeout=30)
    except grpc.RpcError as err:
        return (err.code(), err.details())
    if isinstance(response, pb.AttendResponse):
        response.ClearField("timing")
    stored = shm.get_contents_as_numpy(region, np.uint8, [size]).copy()
    return (response.SerializeToString(deterministic=True), stored.tobytes())


_X = np.random.default_rng(11).standard_normal((N, SEQ, D), dtype=np.float32)


def test_the_gateway_answers_region_references_as_the_python_front_end(
    repository: Path,
) -> None:
    """Every call naming client shared memory, good or bad, gets the same answer (fields,
    region bytes) or the same status and message whether the gateway serves the port (its
    fast path reads the references) or the Python front end does."""
    made = Objects()
    size = 2 * IN_BYTES + WEIGHTS_BYTES
    flags = ("--default-model", "small", "--client-shared-memory", "on")
    outcomes: dict[str, dict[str, object]] = {}
    try:
        region, key = made.make("io", size)
        for gateway in ("on", "off"):
            with (
                ServerProcess(repository, *flags, "--grpc-gateway", gateway) as server,
                grpc.insecure_channel(server.target) as channel,
            ):
                control = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                control.SystemSharedMemoryRegister(
                    v2.SystemSharedMemoryRegisterRequest(name="io", key=key, byte_size=size)
                )
                # Sent as bytes: a case may be bytes no message object would serialize to.
                attend = channel.unary_unary(
                    "/attention.v1.AttentionService/Attend",
                    request_serializer=_serialized,
                    response_deserializer=pb.AttendResponse.FromString,
                )
                infer = channel.unary_unary(
                    "/inference.GRPCInferenceService/ModelInfer",
                    request_serializer=_serialized,
                    response_deserializer=v2.ModelInferResponse.FromString,
                )
                calls = {
                    **{name: (infer, message) for name, message in _v2_cases(_X).items()},
                    **{name: (attend, message) for name, message in _attend_cases().items()},
                }
                outcomes[gateway] = {
                    name: _outcome(call, message, region, size)
                    for name, (call, message) in calls.items()
                }
    finally:
        for handle in list(made.handles):
            made.destroy(handle)
    on, off = outcomes["on"], outcomes["off"]
    for name in off:
        assert on[name] == off[name], name
    answered = [name for name, got in off.items() if isinstance(got[0], bytes)]
    assert "a map entry of two fields (control)" in answered
    assert "a map entry with a third field" not in answered
    assert len(answered) >= 10, off  # the good ones were answered, not all refused
    response = v2.ModelInferResponse.FromString(off["input and output"][0])
    assert response.outputs[0].parameters["shared_memory_region"].string_param == "io"
    assert response.raw_output_contents == [b""]


def test_a_status_lists_its_regions_in_key_order_on_the_wire(
    shm_server: ServerProcess, objects: Objects
) -> None:
    """Every answer is serialized deterministically (docs/api.md): the regions' map in key
    order whatever the order of registration (three regions came in the order w, in, out;
    six in any other order than the keys' is next to certain)."""
    names = ("w", "in", "out", "b", "z", "a")
    assert len(names) <= MAX_REGIONS
    with triton.InferenceServerClient(shm_server.target) as client:
        for name in names:
            _, key = objects.make(name, 64)
            client.register_system_shared_memory(name, key, 64)
    raw = RawGrpc(shm_server.grpc_port)
    try:
        request = v2.SystemSharedMemoryStatusRequest().SerializeToString()
        path = "/inference.GRPCInferenceService/SystemSharedMemoryStatus"
        stream = raw.open(path, len(request).to_bytes(5, "big") + request)
        (answer,) = raw.wait(stream).messages()
    finally:
        raw.close()
    status = v2.SystemSharedMemoryStatusResponse.FromString(answer)
    assert sorted(status.regions) == sorted(names)
    assert answer == status.SerializeToString(deterministic=True)
