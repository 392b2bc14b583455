"""KServe V2 over HTTP/REST, driven by tritonclient.http and by plain HTTP bodies, against the
real server; numbers compared with torch and with the gRPC answer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from export.pipeline import ExportRequest, run_export
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import ServerProcess, in_mode

D, H = 64, 4
MAX_BATCH, MAX_SEQ = 4, 16
# The server's body limit: the largest legal request plus 1 MiB of envelope (message_limits).
BODY_LIMIT = MAX_BATCH * MAX_SEQ * D * 4 + (1 << 20)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rest-models")
    run_export(ExportRequest(name="small", embed_dim=D, num_heads=H, out=root))
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    flags = (
        "--default-model",
        "small",
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-seq-len",
        str(MAX_SEQ),
    )
    with ServerProcess(repository, *flags, http=True) as process:
        yield process
    assert process.process.returncode == 0, process.log


@pytest.fixture(scope="module")
def grpc_server(server: ServerProcess, grpc_gateway: str) -> Iterator[ServerProcess]:
    """The server in each gateway mode, for the answers compared over gRPC (REST is the
    Python front end's in both)."""
    with in_mode(server, grpc_gateway) as process:
        yield process


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(server.http_url)
    yield client
    client.close()


def _post(server: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None):
    """(status, headers, body) of a POST, error statuses included."""
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=body, headers=headers or {}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _embeddings(n: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, seq, D)).astype(np.float32)


def test_health_metadata_config_stats_and_repository(
    server: ServerProcess, http: triton_http.InferenceServerClient
) -> None:
    assert http.is_server_live()
    assert http.is_server_ready()
    assert http.is_model_ready("small")
    assert http.is_model_ready("small", "1")
    assert not http.is_model_ready("small", "9")
    assert not http.is_model_ready("nope")
    assert http.get_server_metadata()["extensions"] == [
        "binary_tensor_data",
        "model_configuration",
        "statistics",
        "model_repository",
        "logging",
    ]
    metadata = http.get_model_metadata("small")
    assert metadata["inputs"] == [{"name": "embeddings", "datatype": "FP32", "shape": [-1, -1, D]}]
    config = http.get_model_config("small")
    assert config["max_batch_size"] == MAX_BATCH
    assert config["input"][0]["dims"] == [-1, D]
    stats = http.get_inference_statistics("small")["model_stats"][0]
    assert isinstance(stats["inference_count"], int)  # numbers, as Triton writes them
    assert http.get_model_repository_index() == [
        {"name": "small", "version": "1", "state": "READY", "reason": ""}
    ]
    assert server.metric("attention_requests_total", api="rest", code="OK") >= 9


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_infers_as_torch_and_grpc(
    grpc_server: ServerProcess, http: triton_http.InferenceServerClient, binary: bool
) -> None:
    x = _embeddings(2, 7)
    tensor = triton_http.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    outputs = [
        triton_http.InferRequestedOutput(name, binary_data=binary)
        for name in ("output", "attention_weights")
    ]
    result = http.infer("small", [tensor], outputs=outputs, request_id="r-1")
    expected_output, expected_weights = attend_alone(layer_for(D, H), x)
    np.testing.assert_allclose(result.as_numpy("output"), expected_output, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("attention_weights"), expected_weights, atol=1e-5)
    assert result.get_response()["id"] == "r-1"
    grpc_client = triton_grpc.InferenceServerClient(grpc_server.target)
    grpc_tensor = triton_grpc.InferInput("embeddings", list(x.shape), "FP32")
    grpc_tensor.set_data_from_numpy(x)
    over_grpc = grpc_client.infer("small", [grpc_tensor]).as_numpy("output")
    grpc_client.close()
    np.testing.assert_array_equal(result.as_numpy("output"), over_grpc)


def test_weights_only_when_listed_in_outputs(http: triton_http.InferenceServerClient) -> None:
    x = _embeddings(1, 5)
    tensor = triton_http.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = http.infer("small", [tensor])
    assert result.as_numpy("attention_weights") is None
    assert [o["name"] for o in result.get_response()["outputs"]] == ["output"]


def test_plain_json_body_with_versioned_path(server: ServerProcess) -> None:
    x = _embeddings(1, 3)
    body = {
        "inputs": [
            {
                "name": "embeddings",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
        ]
    }
    status, headers, raw = _post(
        server, "/v2/models/small/versions/1/infer", json.dumps(body).encode()
    )
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    answer = json.loads(raw)
    assert answer["model_name"] == "small"
    assert answer["model_version"] == "1"
    (output,) = answer["outputs"]
    assert output["shape"] == [1, 3, D]
    assert output["datatype"] == "FP32"
    expected, _ = attend_alone(layer_for(D, H), x)
    np.testing.assert_allclose(np.reshape(output["data"], output["shape"]), expected, atol=1e-4)


def _json_error(status: int, raw: bytes) -> str:
    message = json.loads(raw)["error"]
    assert isinstance(message, str)
    assert message
    return message


BAD_BODIES = [
    (b"{bad", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests arrays or objects too deeply"),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 2, 64], "datatype": "FP32",'
        b' "data": [1.0, 2.0]}]}',
        "data has 2 values; shape [1, 2, 64] needs 128",
    ),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 1, 64], "datatype": "FP32",'
        b' "data": [true]}]}',
        "booleans",
    ),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 1, 2], "datatype": "FP32",'
        b' "data": [1.0, 2.0]}]}',
        "expects d=64",
    ),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 1, 64], "datatype": "FP32",'
        b' "data": [' + b",".join([b"0.5"] * 64) + b']}], "outputs": [{"name": "logits"}]}',
        "outputs are ['output', 'attention_weights']",
    ),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 1, 64], "datatype": "FP32",'
        b' "data": [' + b",".join([b"0.5"] * 64) + b']}], "parameters": {"priority": 1}}',
        "parameter 'priority'",
    ),
    (b'{"inputs": "embeddings"}', "inputs is"),
    (b'{"id": "a\\ud800b", "inputs": []}', "id holds a lone UTF-16 surrogate at character 1"),
    (b'{"inputs": [{"name": "\\udfff", "shape": [1], "datatype": "FP32"}]}', "lone UTF-16"),
    (b'{"parameters": {"\\ud800": 1}, "inputs": []}', "request parameter name holds"),
    (b'{"parameters": {"x": "\\ud800"}, "inputs": []}', "request parameter 'x' holds"),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 99, 64], "datatype": "FP32",'
        b' "parameters": {"binary_data_size": 4}}]}',
        "binary_data_size is 4, but only 0 bytes",
    ),
    (
        b'{"inputs": [{"name": "embeddings", "shape": [1, 99, 64], "datatype": "FP32",'
        b' "parameters": {"binary_data_size": -1}}]}',
        "binary_data_size is -1; expected a byte count >= 0",
    ),
]


@pytest.mark.parametrize(("body", "says"), BAD_BODIES)
def test_bad_bodies_get_400_with_a_json_error(
    server: ServerProcess, body: bytes, says: str
) -> None:
    status, headers, raw = _post(server, "/v2/models/small/infer", body)
    assert status == 400, raw
    assert headers["Content-Type"].startswith("application/json")
    assert says in _json_error(status, raw)


def test_binary_extension_header_checked(server: ServerProcess) -> None:
    x = _embeddings(1, 2)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "embeddings",
                    "shape": [1, 2, D],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    status, headers, raw = _post(
        server,
        "/v2/models/small/infer",
        header + x.tobytes(),
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200
    json_length = int(headers["Inference-Header-Content-Length"])
    answer = json.loads(raw[:json_length])
    assert answer["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes
    expected, _ = attend_alone(layer_for(D, H), x)
    got = np.frombuffer(raw[json_length:], "<f4").reshape(1, 2, D)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    status, _, raw = _post(
        server,
        "/v2/models/small/infer",
        header + x.tobytes() + b"xx",
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400
    assert "2 bytes of binary data" in _json_error(status, raw)
    status, _, raw = _post(
        server, "/v2/models/small/infer", header, {"Inference-Header-Content-Length": "abc"}
    )
    assert status == 400
    assert "Inference-Header-Content-Length is 'abc'" in _json_error(status, raw)


def test_codes_from_the_error_table(server: ServerProcess) -> None:
    status, _, raw = _post(server, "/v2/models/nope/infer", b"{}")
    assert status == 404
    assert "unknown model 'nope'" in _json_error(status, raw)
    too_long = _embeddings(1, MAX_SEQ + 1)
    tensor = {
        "name": "embeddings",
        "shape": list(too_long.shape),
        "datatype": "FP32",
        "data": too_long.ravel().tolist(),
    }
    status, _, raw = _post(
        server, "/v2/models/small/infer", json.dumps({"inputs": [tensor]}).encode()
    )
    assert status == 400
    assert str(MAX_SEQ) in _json_error(status, raw)
    status, _, raw = _post(server, "/v2/repository/models/small/load", b"{}")
    assert status == 400
    assert "--model-control-mode none" in _json_error(status, raw)
    request = urllib.request.Request(f"http://{server.http_url}/v2/health/nope")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 404
    assert "/v2/health/" in json.loads(refused.value.read())["error"]
    before = server.metric("attention_requests_total", api="rest", code="NOT_FOUND")
    _post(server, "/v2/models/nope/infer", b"{}")
    assert server.metric("attention_requests_total", api="rest", code="NOT_FOUND") == before + 1


def test_body_above_the_message_limit_is_refused_before_it_is_read(server: ServerProcess) -> None:
    status, _, raw = _post(server, "/v2/models/small/infer", b" " * (BODY_LIMIT + 1))
    assert status == 413
    assert f"limit of {BODY_LIMIT} bytes" in _json_error(status, raw)


def test_tritonclient_http_sees_the_error_message(http: triton_http.InferenceServerClient) -> None:
    tensor = triton_http.InferInput("embeddings", [1, 2, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2, 3), np.float32))
    with pytest.raises(InferenceServerException, match="expects d=64") as refused:
        http.infer("small", [tensor])
    assert refused.value.status() == "400"


def test_a_json_answer_is_reserved_at_its_json_size() -> None:
    """The undelivered-answers budget takes a REST answer at the size it will be written in:
    binary outputs at 4 bytes a value, JSON ones at up to 26 characters a value (reserved
    before computing, so the bound cannot be overshot by answers that grow in the encoding)."""
    from types import SimpleNamespace

    from service.frontend.delivery import MEMORY_PER_ANSWER_BYTE, AnswerBudget
    from service.frontend.rest.codec import InferBody
    from service.frontend.rest.routes import JSON_BYTES_PER_VALUE, _Endpoints
    from service.generated.inference import grpc_service_pb2 as v2

    sizes = {"output": (4000, 4), "attention_weights": (8000, 4)}
    plane = SimpleNamespace(answer_sizes=lambda request: sizes)
    budget = AnswerBudget(1 << 30, 1 << 30)
    frontend = SimpleNamespace(answers=budget, max_json_answer_bytes=1 << 20)
    endpoints = _Endpoints(plane, frontend)  # type: ignore[arg-type]
    request = SimpleNamespace(transport=None)
    body = InferBody(v2.ModelInferRequest(), {"output": True}, binary_default=False)
    estimate = endpoints._json_answer_bounded(body)
    assert estimate == 4000 + 8000 // 4 * JSON_BYTES_PER_VALUE
    held = endpoints._reserve(request, estimate)  # type: ignore[arg-type]
    assert held is not None
    assert held.nbytes == MEMORY_PER_ANSWER_BYTE * estimate
    held.release()
    binary = InferBody(v2.ModelInferRequest(), {}, binary_default=True)
    assert endpoints._json_answer_bounded(binary) == 12000
    assert budget.total == 0
