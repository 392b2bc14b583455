"""AttentionService round trips over real gRPC, compared with ORT and nn.MultiheadAttention."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from service.client import AsyncAttentionClient, AttentionClient, attend_request, attend_result
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.memory.budget import TRIM_AFTER_BATCH_BYTES, is_large_batch
from tests.harness.providers import serving_provider
from tests.harness.reference import attend_alone, cpu_session, layer_for
from tests.harness.server_process import ServerProcess, behind_gateway, gateway_mode

D, H = 512, 8


@pytest.fixture(scope="module")
def reference():
    return layer_for(D, H)


@pytest.mark.parametrize("shape", [(1, D), (17, D), (128, D), (3, 9, D)])
def test_round_trip_equals_torch_and_onnx_runtime(
    client: AttentionClient, reference, model_repository: Path, shape: tuple[int, ...]
) -> None:
    x = np.random.default_rng(sum(shape)).standard_normal(shape, dtype=np.float32)
    result = client.attend(x, request_id="rt-1")
    want_output, _ = attend_alone(reference, x)
    assert result.output.shape == shape
    assert result.attention_weights is None
    assert (result.model, result.model_version, result.request_id) == ("mha", "1", "rt-1")
    assert result.batch_size >= (shape[0] if len(shape) == 3 else 1)
    np.testing.assert_allclose(result.output, want_output, atol=1e-5, rtol=0)

    batch = x if x.ndim == 3 else x[None]
    session = cpu_session(model_repository / "mha" / "1" / "model.onnx")
    (ort_output,) = session.run(
        None, {"embeddings": batch, "key_padding_mask": np.zeros(batch.shape[:2], bool)}
    )
    np.testing.assert_allclose(result.output, ort_output.reshape(shape), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(11, D), (2, 5, D)])
def test_weights_come_back_only_when_asked(
    client: AttentionClient, server: ServerProcess, reference, shape: tuple[int, ...]
) -> None:
    x = np.random.default_rng(5).standard_normal(shape, dtype=np.float32)
    weights_batches = server.metric(
        "attention_batches_total", model="mha", graph="output+attention_weights"
    )
    plain = client.attend(x)
    assert plain.attention_weights is None
    assert (
        server.metric("attention_batches_total", model="mha", graph="output+attention_weights")
        == weights_batches
    ), "a request without weights ran the weights graph"

    full = client.attend(x, return_attention_weights=True)
    want_output, want_weights = attend_alone(reference, x)
    seq = shape[-2]
    assert full.attention_weights is not None
    assert full.attention_weights.shape == (*shape[:-2], H, seq, seq)
    assert full.attention_weights.dtype == np.float32
    np.testing.assert_allclose(full.attention_weights, want_weights, atol=1e-6, rtol=0)
    np.testing.assert_allclose(full.output, want_output, atol=1e-5, rtol=0)
    np.testing.assert_allclose(full.output, plain.output, atol=1e-6, rtol=0)


@pytest.mark.parametrize("weights", [False, True])
def test_a_large_batch_is_exact_on_the_path_that_gives_its_memory_back(
    client: AttentionClient, reference, weights: bool
) -> None:
    """Batches this large run with their outputs bound to arrays of the worker's own, so the
    arena can give back what they took (--cpu-arena bounded); the results are the same."""
    seq = 256
    n = -(-TRIM_AFTER_BATCH_BYTES // ((4 if weights else 1) * seq * D * 4))
    x = np.random.default_rng(9).standard_normal((n, seq, D), dtype=np.float32)
    assert is_large_batch(x, weights)
    result = client.attend(x, return_attention_weights=weights)
    want_output, want_weights = attend_alone(reference, x)
    np.testing.assert_allclose(result.output, want_output, atol=1e-5, rtol=0)
    if weights:
        np.testing.assert_allclose(result.attention_weights, want_weights, atol=1e-6, rtol=0)


def test_calls_cancelled_at_any_moment_leave_the_others_exact(
    server: ServerProcess, reference
) -> None:
    """The worker writes answers straight into the front end's shared memory; a call
    cancelled while its batch computes must not have its regions reused before the batch
    is done, or another call's answer would be overwritten."""
    calls = 600
    callers = 32
    rng = np.random.default_rng(21)
    inputs = [rng.standard_normal((2, 16 + i % 5, D), dtype=np.float32) for i in range(calls)]
    delays = rng.uniform(0.0, 0.02, calls)

    async def run() -> list[pb.AttendResponse | None]:
        # Callers one after another on few connections, so a cancelled call's freed regions
        # are soon taken by the next call's request and answer.
        answers: list[pb.AttendResponse | None] = [None] * calls
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)

            async def caller(first: int) -> None:
                for i in range(first, calls, callers):
                    call = stub.Attend(attend_request(inputs[i]), timeout=60)
                    if i % 2 == 0:  # cancelled: queued, computing or answered by then
                        await asyncio.sleep(delays[i])
                        call.cancel()
                    else:
                        answers[i] = await call

            await asyncio.gather(*(caller(first) for first in range(callers)))
        return answers

    answers = asyncio.run(run())
    for x, answer in zip(inputs, answers, strict=True):
        if answer is not None:
            want, _ = attend_alone(reference, x)
            np.testing.assert_allclose(attend_result(answer).output, want, atol=1e-5, rtol=0)
    assert sum(answer is not None for answer in answers) == calls // 2
    client = AttentionClient(server.target)  # and the server serves on
    assert client.attend(inputs[1]).output.shape == inputs[1].shape
    client.close()


def test_float16_input_gets_float16_output(client: AttentionClient, reference) -> None:
    x = np.random.default_rng(2).standard_normal((6, D)).astype(np.float16)
    result = client.attend(x)
    assert result.output.dtype == np.float16
    want, _ = attend_alone(reference, x.astype(np.float32))
    np.testing.assert_allclose(result.output.astype(np.float32), want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float16_model_answers_in_the_callers_dtype(client: AttentionClient, dtype) -> None:
    x = np.random.default_rng(8).standard_normal((2, 7, 64)).astype(dtype)
    result = client.attend(x, model="half", return_attention_weights=True)
    want_output, want_weights = attend_alone(layer_for(64, 4), x.astype(np.float32))
    assert result.output.dtype == dtype
    assert result.attention_weights is not None
    assert result.attention_weights.dtype == np.float32
    np.testing.assert_allclose(result.output.astype(np.float32), want_output, atol=1e-2, rtol=0)
    np.testing.assert_allclose(result.attention_weights, want_weights, atol=1e-2, rtol=0)


def test_versions_and_models_are_listed(client: AttentionClient) -> None:
    models = {info.name: info for info in client.list_models()}
    assert set(models) == {"mha", "small", "causal", "half"}
    assert models["half"].versions[0].dtype == pb.FLOAT16
    assert [v.version for v in models["small"].versions] == ["2", "1"]
    mha = client.get_model()
    assert mha.name == "mha"
    assert (mha.versions[0].embed_dim, mha.versions[0].num_heads) == (D, H)
    assert mha.versions[0].execution_provider == serving_provider()
    assert models["causal"].versions[0].causal


def test_model_version_is_honoured(client: AttentionClient) -> None:
    x = np.random.default_rng(3).standard_normal((4, 64), dtype=np.float32)
    v1 = client.attend(x, model="small", model_version="1")
    v2 = client.attend(x, model="small", model_version="2")
    newest = client.attend(x, model="small")
    assert (v1.model_version, v2.model_version, newest.model_version) == ("1", "2", "2")
    np.testing.assert_allclose(v1.output, attend_alone(layer_for(64, 4), x)[0], atol=1e-5)
    np.testing.assert_allclose(v2.output, attend_alone(layer_for(64, 4, seed=7), x)[0], atol=1e-5)


def test_causal_model_round_trip(client: AttentionClient) -> None:
    x = np.random.default_rng(4).standard_normal((10, 32), dtype=np.float32)
    result = client.attend(x, model="causal", return_attention_weights=True)
    want, want_weights = attend_alone(layer_for(32, 2), x, causal=True)
    np.testing.assert_allclose(result.output, want, atol=1e-5, rtol=0)
    assert result.attention_weights is not None
    np.testing.assert_allclose(result.attention_weights, want_weights, atol=1e-6, rtol=0)
    assert np.all(np.triu(result.attention_weights, 1) == 0)


def test_concurrent_mixed_requests_batch_and_stay_exact(server: ServerProcess, reference) -> None:
    """250 concurrent calls of mixed lengths and weight flags: each equals its unbatched result."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 65, size=250)
    inputs = [rng.standard_normal((int(n), D), dtype=np.float32) for n in lengths]
    flags = rng.random(250) < 0.3
    batches_before = server.metric("attention_batch_size_sequences_count", model="mha")

    async def send_all():
        async with AsyncAttentionClient(server.target) as client:
            return await asyncio.gather(
                *(
                    client.attend(x, return_attention_weights=bool(flag), request_id=str(i))
                    for i, (x, flag) in enumerate(zip(inputs, flags, strict=True))
                )
            )

    results = asyncio.run(send_all())
    for i, (x, flag, result) in enumerate(zip(inputs, flags, results, strict=True)):
        assert result.request_id == str(i)
        want_output, want_weights = attend_alone(reference, x)
        np.testing.assert_allclose(result.output, want_output, atol=1e-5, rtol=0)
        if flag:
            np.testing.assert_allclose(result.attention_weights, want_weights, atol=1e-6, rtol=0)
        else:
            assert result.attention_weights is None
    sizes = [result.batch_size for result in results]
    assert max(sizes) > 1, "no batch larger than one formed"
    batches = server.metric("attention_batch_size_sequences_count", model="mha") - batches_before
    assert batches < len(results), f"{batches} ONNX Runtime calls for {len(results)} requests"


def test_cli_client_prints_a_summary(server: ServerProcess, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "service.client", "--target", server.target]
    done = subprocess.run(
        [*base, "--requests", "8", "--concurrency", "4", "--seq", "12", "--weights"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "output [12, 512]" in done.stdout
    assert "attention_weights [8, 12, 12]" in done.stdout
    assert "req/s" in done.stdout
    npy = tmp_path / "x.npy"
    np.save(npy, np.ones((2, 3, 64), np.float32))
    given = subprocess.run(
        [*base, "--npy", str(npy), "--model", "small"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "output [2, 3, 64]" in given.stdout
    bad = subprocess.run(
        [*base, "--model", "nope"], capture_output=True, text=True, check=False, timeout=60
    )
    assert bad.returncode == 1
    assert "NOT_FOUND" in bad.stderr


def test_reflection_lists_every_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {
        "attention.v1.AttentionService",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    # What grpcurl and friends do next: fetch each service's file, its imports included.
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        v2_file = database.FindFileContainingSymbol("inference.GRPCInferenceService")
        attention_file = database.FindFileContainingSymbol("attention.v1.AttentionService")
        config_file = database.FindFileByName("inference/model_config.proto")
    assert v2_file.name == "inference/grpc_service.proto"
    assert "ModelStreamInfer" in [method.name for method in v2_file.service[0].method]
    assert attention_file.name == "attention/v1/attention.proto"
    assert "ModelConfig" in [message.name for message in config_file.message_type]


def test_client_with_dns_target_and_round_robin(server: ServerProcess) -> None:
    target = f"dns:///127.0.0.1:{server.grpc_port}"
    with AttentionClient(target, load_balancing="round_robin") as balanced:
        assert balanced.attend(np.ones((3, D), np.float32)).output.shape == (3, D)


def test_round_robin_spreads_requests_over_every_backend(
    server: ServerProcess, model_repository: Path
) -> None:
    """Two backends behind one target: with round_robin each serves its share."""

    def served(backend: ServerProcess) -> float:
        return backend.metric("attention_requests_total", model="mha", api="attention", code="OK")

    mode = {"ATTENTION_GRPC_GATEWAY": gateway_mode(server)}  # both backends alike
    with ServerProcess(model_repository, "--batch-cap-budget-s", "0", env=mode) as other:
        before = [served(server), served(other)]
        target = f"ipv4:127.0.0.1:{server.grpc_port},127.0.0.1:{other.grpc_port}"
        with AttentionClient(target, load_balancing="round_robin") as balanced:
            balanced.wait_until_serving(30)
            for _ in range(10):
                balanced.attend(np.ones((3, D), np.float32))
        counts = [served(server) - before[0], served(other) - before[1]]
    assert sum(counts) == 10
    assert min(counts) >= 3, counts  # a pick-first client would send all 10 to one


def test_the_shared_server_runs_in_both_gateway_modes(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """conftest's server is started once with the gateway and once without it."""
    assert behind_gateway(server) == (request.node.callspec.params["server"] == "on")


# Padded: x (16) beside sequences of 18. The shared server keeps its default padding bound
# (0.05 of a batch on a CPU), which a batch holding x and two or more others stays within.
@pytest.mark.parametrize("others_length", [16, 18], ids=["same-length", "padded"])
def test_a_batch_of_one_in_place_equals_the_same_sequence_batched(
    server: ServerProcess, reference, others_length: int
) -> None:
    """A lone call runs as a batch of one on its own bytes (no merge copy); the same sequence
    batched with others (of its length, or longer so that it is padded) gives the same answer
    within 1e-5 relative, and both equal torch's."""
    rng = np.random.default_rng(others_length)
    x = rng.standard_normal((16, D), dtype=np.float32)
    others = [rng.standard_normal((others_length, D), dtype=np.float32) for _ in range(23)]
    with AttentionClient(server.target) as client:
        alone = client.attend(x, request_id="alone")
    assert alone.batch_size == 1

    async def beside_others() -> list:
        async with AsyncAttentionClient(server.target) as client:
            return await asyncio.gather(
                *(client.attend(y) for y in [*others[:11], x, *others[11:]])
            )

    # Concurrent calls batch together as a rule, but which batch x lands in is the
    # scheduler's: a few tries until it shares one.
    for _ in range(10):
        batched = asyncio.run(beside_others())[11]
        if batched.batch_size > 1:
            break
    assert batched.batch_size > 1, "x never shared a batch in 10 tries of 24 concurrent calls"
    np.testing.assert_allclose(batched.output, alone.output, rtol=1e-5, atol=1e-6)
    want_output, _ = attend_alone(reference, x)
    np.testing.assert_allclose(alone.output, want_output, atol=1e-5, rtol=0)
