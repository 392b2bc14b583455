"""The Open Inference Protocol endpoint, driven by tritonclient exactly as users drive Triton."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from bench.harness import wait_for
from service.client import AsyncAttentionClient, AttentionClient
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import ServerProcess

D, H = 512, 8


@pytest.fixture(scope="module")
def v2(server: ServerProcess):
    client = triton.InferenceServerClient(server.target)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference():
    return layer_for(D, H)


def _input(x: np.ndarray, name: str = "embeddings", datatype: str = "FP32") -> triton.InferInput:
    tensor = triton.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return tensor


def test_server_and_model_state(server: ServerProcess, v2: triton.InferenceServerClient) -> None:
    before = server.metric("attention_requests_total", model="_server", api="v2", code="OK")
    assert v2.is_server_live()
    assert (
        server.metric("attention_requests_total", model="_server", api="v2", code="OK")
        == before + 1
    )
    assert v2.is_server_ready()
    assert v2.is_model_ready("mha")
    assert v2.is_model_ready("small", "1")
    assert not v2.is_model_ready("small", "9")
    assert not v2.is_model_ready("nope")
    metadata = v2.get_server_metadata(as_json=True)
    assert metadata["name"] == "attention-serving"
    assert set(metadata["extensions"]) == {
        "binary_tensor_data",
        "model_configuration",
        "statistics",
        "model_repository",
        "logging",
    }


def test_model_metadata_and_config(v2: triton.InferenceServerClient) -> None:
    metadata = v2.get_model_metadata("small", as_json=True)
    assert metadata["versions"] == ["2", "1"]
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [
        {"name": "embeddings", "datatype": "FP32", "shape": ["-1", "-1", "64"]}
    ]
    assert [o["name"] for o in metadata["outputs"]] == ["output", "attention_weights"]
    assert metadata["outputs"][1]["shape"] == ["-1", "4", "-1", "-1"]
    config = v2.get_model_config("mha", as_json=True)["config"]
    assert config["name"] == "mha"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == 32
    assert config["input"][0] == {
        "name": "embeddings",
        "data_type": "TYPE_FP32",
        "dims": ["-1", "512"],
    }
    assert config["output"][1]["dims"] == ["8", "-1", "-1"]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "5000"
    with pytest.raises(InferenceServerException) as caught:
        v2.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_infer_equals_attention_service_and_torch(
    v2: triton.InferenceServerClient, client: AttentionClient, reference
) -> None:
    x = np.random.default_rng(0).standard_normal((2, 9, D), dtype=np.float32)
    plain = v2.infer("mha", [_input(x)], request_id="v2-1")
    assert plain.get_response().id == "v2-1"
    assert plain.as_numpy("attention_weights") is None
    assert [o.name for o in plain.get_response().outputs] == ["output"]
    want_output, want_weights = attend_alone(reference, x)
    np.testing.assert_allclose(plain.as_numpy("output"), want_output, atol=1e-5, rtol=0)
    np.testing.assert_allclose(plain.as_numpy("output"), client.attend(x).output, atol=1e-6, rtol=0)

    outputs = [
        triton.InferRequestedOutput("output"),
        triton.InferRequestedOutput("attention_weights"),
    ]
    full = v2.infer("mha", [_input(x)], outputs=outputs)
    np.testing.assert_allclose(full.as_numpy("attention_weights"), want_weights, atol=1e-6, rtol=0)
    np.testing.assert_allclose(full.as_numpy("output"), want_output, atol=1e-5, rtol=0)

    only = v2.infer("mha", [_input(x)], outputs=[triton.InferRequestedOutput("attention_weights")])
    assert [o.name for o in only.get_response().outputs] == ["attention_weights"]
    assert only.as_numpy("attention_weights").shape == (2, H, 9, 9)


def test_model_version_is_honoured(v2: triton.InferenceServerClient) -> None:
    x = np.random.default_rng(1).standard_normal((1, 4, 64), dtype=np.float32)
    first = v2.infer("small", [_input(x)], model_version="1")
    assert first.get_response().model_version == "1"
    np.testing.assert_allclose(
        first.as_numpy("output"), attend_alone(layer_for(64, 4), x)[0], atol=1e-5
    )
    assert v2.infer("small", [_input(x)]).get_response().model_version == "2"


def test_float16_model_says_it_takes_fp32_too(v2: triton.InferenceServerClient) -> None:
    parameters = v2.get_model_config("half").config.parameters
    assert parameters["accepted_input_datatypes"].string_value == "FP16,FP32"
    assert (
        v2.get_model_config("small").config.parameters["accepted_input_datatypes"].string_value
        == "FP32"
    )


def test_float16_model_takes_fp16_and_fp32(v2: triton.InferenceServerClient) -> None:
    metadata = v2.get_model_metadata("half", as_json=True)
    assert metadata["inputs"][0]["datatype"] == "FP16"
    x = np.random.default_rng(4).standard_normal((1, 6, 64))
    want = attend_alone(layer_for(64, 4), x.astype(np.float16).astype(np.float32))[0]
    for datatype, dtype in (("FP16", np.float16), ("FP32", np.float32)):
        result = v2.infer("half", [_input(x.astype(dtype), datatype=datatype)])
        assert result.get_response().outputs[0].datatype == "FP16"
        np.testing.assert_allclose(result.as_numpy("output").astype(np.float32), want, atol=1e-2)
    with pytest.raises(InferenceServerException) as caught:
        v2.infer("small", [_input(x.astype(np.float16), datatype="FP16")])
    assert "expects FP32" in caught.value.message()


def test_typed_fp32_contents_equal_raw(
    server: ServerProcess, v2: triton.InferenceServerClient
) -> None:
    """A request built with tritonclient's own protobuf classes, using typed contents."""
    x = np.random.default_rng(2).standard_normal((1, 5, 64), dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name="small", id="typed")
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 5, 64])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(server.target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    typed = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(1, 5, 64)
    raw = v2.infer("small", [_input(x)]).as_numpy("output")
    np.testing.assert_array_equal(typed, raw)
    assert response.id == "typed"


def _raw_and_typed() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="small")
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 1, 64])
    tensor.contents.fp32_contents.extend([0.0] * 64)
    request.raw_input_contents.append(np.zeros(64, np.float32).tobytes())
    return request


BAD = {
    "input name": (
        lambda: [_input(np.ones((1, 2, 64), np.float32), name="x")],
        {},
        "StatusCode.INVALID_ARGUMENT",
        "unexpected inference input 'x'",
    ),
    "unnamed input": (
        lambda: [_input(np.ones((1, 2, 64), np.float32), name="")],
        {},
        "StatusCode.INVALID_ARGUMENT",
        "unexpected inference input ''",
    ),
    "datatype": (
        lambda: [_input(np.ones((1, 2, 64)), datatype="FP64")],
        {},
        "StatusCode.INVALID_ARGUMENT",
        "datatype FP64; model 'small' version 2 expects FP32",
    ),
    "shape rank": (
        lambda: [_input(np.ones((2, 64), np.float32))],
        {},
        "StatusCode.INVALID_ARGUMENT",
        "expects [n, seq, 64]",
    ),
    "wrong d": (
        lambda: [_input(np.ones((1, 2, 32), np.float32))],
        {},
        "StatusCode.INVALID_ARGUMENT",
        "expects d=64",
    ),
    "output name": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"outputs": [triton.InferRequestedOutput("logits")]},
        "StatusCode.INVALID_ARGUMENT",
        "unexpected inference output 'logits'",
    ),
    "model": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"model_name": "nope"},
        "StatusCode.NOT_FOUND",
        "unknown model 'nope'",
    ),
    "version": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"model_version": "7"},
        "StatusCode.NOT_FOUND",
        "no version '7'",
    ),
    "nan": (
        lambda: [_input(np.full((1, 2, 64), np.nan, np.float32))],
        {},
        "StatusCode.INVALID_ARGUMENT",
        "non-finite",
    ),
    "class_count": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"outputs": [triton.InferRequestedOutput("output", class_count=3)]},
        "StatusCode.INVALID_ARGUMENT",
        "output 'output' has parameter 'classification', which this server does not implement",
    ),
    "priority": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"priority": 2},
        "StatusCode.INVALID_ARGUMENT",
        "request has parameter 'priority'",
    ),
    "odd version": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"model_version": "²"},
        "StatusCode.NOT_FOUND",
        "no version '²'",
    ),
    "long model name": (
        lambda: [_input(np.ones((1, 2, 64), np.float32))],
        {"model_name": "m" * 20000},
        "StatusCode.NOT_FOUND",
        "(19936 more characters)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_v2_requests_fail_clearly(v2: triton.InferenceServerClient, case: str) -> None:
    make_inputs, kwargs, status, message = BAD[case]
    kwargs = {"model_name": "small", **kwargs}
    with pytest.raises(InferenceServerException) as caught:
        v2.infer(inputs=make_inputs(), **kwargs)
    assert caught.value.status() == status
    assert message in caught.value.message()
    assert v2.infer("small", [_input(np.ones((1, 2, 64), np.float32))]).as_numpy(
        "output"
    ).shape == (1, 2, 64)


def _typed_elsewhere() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="small")
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 1, 64])
    tensor.contents.int_contents.extend([1] * 64)
    return request


def _zero_by_huge(raw: bool) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="small")
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=[0, 2**62, 2**62])
    if raw:
        request.raw_input_contents.append(b"")
    else:
        tensor.contents.SetInParent()
    return request


def test_byte_count_and_double_contents_are_rejected(server: ServerProcess) -> None:
    short = service_pb2.ModelInferRequest(model_name="small")
    short.inputs.add(name="embeddings", datatype="FP32", shape=[1, 2, 64])
    short.raw_input_contents.append(b"\0" * 10)
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for request, message in (
            (short, "has 10 bytes of raw data; shape [1, 2, 64] of FP32 needs 512 bytes"),
            (_raw_and_typed(), "both raw_input_contents and typed contents"),
            (_typed_elsewhere(), "carries its values in contents.int_contents"),
            (_zero_by_huge(raw=True), "every dimension must be at least 1"),
            (_zero_by_huge(raw=False), "every dimension must be at least 1"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in caught.value.details()


def test_inference_statistics_count_requests(v2: triton.InferenceServerClient) -> None:
    def counts() -> tuple[int, int]:
        stats = v2.get_inference_statistics("causal", as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(
            stats["inference_stats"]["success"].get("count", 0)
        )

    before = counts()
    v2.infer("causal", [_input(np.ones((3, 4, 32), np.float32))])
    after = counts()
    assert after == (before[0] + 3, before[1] + 1)
    everything = v2.get_inference_statistics(as_json=True)["model_stats"]
    assert {(s["name"], s["version"]) for s in everything} >= {
        ("mha", "1"),
        ("small", "1"),
        ("small", "2"),
    }


def test_a_request_whose_output_is_not_finite_is_a_failure_not_an_inference(
    v2: triton.InferenceServerClient,
) -> None:
    """Triton's inference_count counts successful inferences. Before: the two sequences
    refused for a NaN or inf output were counted as inferences too."""

    def counts() -> tuple[int, int, int]:
        stats = v2.get_inference_statistics("causal", as_json=True)["model_stats"][0]
        inference = stats["inference_stats"]
        return (
            int(stats.get("inference_count", 0)),
            int(inference["success"].get("count", 0)),
            int(inference["fail"].get("count", 0)),
        )

    before = counts()
    with pytest.raises(InferenceServerException) as caught:
        v2.infer("causal", [_input(np.full((2, 4, 32), 3e38, np.float32))])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "NaN or inf" in caught.value.message()
    assert counts() == (before[0], before[1], before[2] + 1)


def test_unimplemented_calls_say_so(v2: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        v2.get_system_shared_memory_status()
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"


def test_repository_index_lists_every_version_ready(v2: triton.InferenceServerClient) -> None:
    """--model-control-mode none (the default): the index answers; load/unload are refused
    (tests/worker/test_rollout.py covers the refusal and the other modes)."""
    rows = {(m.name, m.version): m.state for m in v2.get_model_repository_index().models}
    assert rows[("small", "1")] == rows[("small", "2")] == rows[("mha", "1")] == "READY"
    assert set(rows.values()) == {"READY"}


def test_both_apis_batch_together(model_repository, grpc_gateway) -> None:
    """With room for exactly 2n sequences, n V2 and n AttentionService calls fill one batch."""
    n = 6
    # Lengths 4..15 pad 0.37 of the batch: within the bound given, on any device.
    flags = ("--max-batch-size", str(2 * n), "--max-queue-delay-ms", "60000")
    flags += ("--max-padding-ratio", "0.5")
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1, 4 + i, 64), dtype=np.float32) for i in range(2 * n)]
    reference_small = layer_for(64, 4, seed=7)

    async def mixed(target: str):
        async with AsyncAttentionClient(target) as ours:
            v2_client = triton_aio.InferenceServerClient(target)
            try:
                v2_calls = [v2_client.infer("small", [_input(x)]) for x in inputs[:n]]
                our_calls = [ours.attend(x, model="small") for x in inputs[n:]]
                return await asyncio.gather(*v2_calls, *our_calls)
            finally:
                await v2_client.close()

    with ServerProcess(model_repository, *flags) as server:
        results = asyncio.run(mixed(server.target))
        assert server.metric("attention_batches_total", model="small") == 1
    for x, result in zip(inputs[:n], results[:n], strict=True):
        np.testing.assert_allclose(
            result.as_numpy("output"), attend_alone(reference_small, x)[0], atol=1e-5
        )
    for x, result in zip(inputs[n:], results[n:], strict=True):
        assert result.batch_size == 2 * n
        np.testing.assert_allclose(result.output, attend_alone(reference_small, x)[0], atol=1e-5)


def test_aio_client_sees_the_same_server(server: ServerProcess) -> None:
    async def session():
        client = triton_aio.InferenceServerClient(server.target)
        try:
            x = np.ones((1, 3, 64), np.float32)
            outputs = [triton.InferRequestedOutput("attention_weights")]
            return (
                await client.is_server_live(),
                await client.is_server_ready(),
                await client.is_model_ready("small"),
                (await client.get_model_metadata("small", as_json=True))["versions"],
                (await client.infer("small", [_input(x)], outputs=outputs))
                .as_numpy("attention_weights")
                .shape,
            )
        finally:
            await client.close()

    assert asyncio.run(session()) == (True, True, True, ["2", "1"], (1, 4, 3, 3))


def test_statistics_metrics_and_counters_tell_one_story(model_repository, grpc_gateway) -> None:
    """Requests dropped at their deadline: the same number in V2 ModelStatistics failures,
    attention_requests_dropped_total and the request counter. Before: 4 against 92."""
    flags = ("--max-queue-delay-ms", "60000", "--max-batch-size", "64", "--batch-cap-budget-s", "0")
    with (
        ServerProcess(model_repository, *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="small", model_version="2")
        request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 3, 64])
        request.raw_input_contents.append(np.ones((1, 3, 64), np.float32).tobytes())
        calls = [stub.ModelInfer.future(request, timeout=0.3) for _ in range(6)]
        assert all(call.code() == grpc.StatusCode.DEADLINE_EXCEEDED for call in calls)
        server.wait_metric("attention_requests_dropped_total", 6, model="small")

        def ended(code: str) -> float:
            return server.metric("attention_requests_total", model="small", code=code)

        # The client gives up at its deadline, the server's timer fires at its own (a little
        # later): which comes first varies, but each request is told once, the same way.
        wait_for(
            lambda: ended("DEADLINE_EXCEEDED") + ended("CANCELLED") >= 6,
            what="the requests in the request counter",
            timeout_s=30,
        )
        stats = stub.ModelStatistics(
            service_pb2.ModelStatisticsRequest(name="small", version="2")
        ).model_stats[0]
        dropped = server.metric("attention_requests_dropped_total", model="small")
        failed = ended("DEADLINE_EXCEEDED") + ended("CANCELLED")
    assert stats.inference_stats.fail.count == dropped == failed == 6
    assert stats.inference_stats.success.count == 0
