"""Triton's timeout parameter (schedule-policy extension, microseconds): a request still
waiting when it passes leaves the queue uncomputed, DEADLINE_EXCEEDED over gRPC and 504 over
REST (the only deadline a REST call can carry); tritonclient's infer(timeout=...) as sent."""

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

from tests.harness.server_process import ServerProcess

# Every server here runs with the gRPC gateway, then without it (the gateway hands calls
# with parameters to Python: both must take the timeout alike).
pytestmark = pytest.mark.usefixtures("grpc_gateway")

D = 64
QUEUE_DELAY_S = 1.5  # a lone request waits this long for others to batch with


@pytest.fixture(scope="module")
def server(model_repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    flags = ("--max-queue-delay-ms", str(int(QUEUE_DELAY_S * 1000)), "--max-batch-size", "8")
    with ServerProcess(model_repository, *flags, http=True) as process:
        yield process


def _grpc_input() -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("embeddings", [1, 4, D], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4, D), np.float32))
    return tensor


def _http_input() -> triton_http.InferInput:
    tensor = triton_http.InferInput("embeddings", [1, 4, D], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4, D), np.float32))
    return tensor


def test_a_request_past_its_timeout_in_the_queue_is_not_computed(server: ServerProcess) -> None:
    dropped = server.metric("attention_requests_dropped_total", reason="deadline")
    client = triton_grpc.InferenceServerClient(server.target)
    with pytest.raises(InferenceServerException) as grpc_refusal:
        client.infer("small", [_grpc_input()], timeout=50_000)  # 50 ms
    client.close()
    assert grpc_refusal.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline passed after" in grpc_refusal.value.message()
    http = triton_http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as http_refusal:
        http.infer("small", [_http_input()], timeout=50_000)
    http.close()
    assert http_refusal.value.status() == "504"
    assert "deadline passed after" in http_refusal.value.message()
    assert server.metric("attention_requests_dropped_total", reason="deadline") == dropped + 2


def test_a_timeout_longer_than_the_wait_or_zero_changes_nothing(server: ServerProcess) -> None:
    with triton_grpc.InferenceServerClient(server.target) as client:
        for timeout in (10_000_000, 0):
            answer = client.infer("small", [_grpc_input()], timeout=timeout)
            assert answer.as_numpy("output").shape == (1, 4, D)
    http = triton_http.InferenceServerClient(server.http_url)
    answer = http.infer("small", [_http_input()], timeout=10_000_000)
    http.close()
    assert answer.as_numpy("output").shape == (1, 4, D)


@pytest.mark.parametrize(
    ("value", "said"),
    [(-5, "is -5"), ("soon", "is 'soon'"), (2.0, "is 2.0"), (True, "is true"), (None, "is 'null'")],
)
def test_a_timeout_that_is_no_count_of_microseconds_is_refused(
    server: ServerProcess, value: object, said: str
) -> None:
    """By JSON (tritonclient checks the type itself before sending)."""
    body = {
        "parameters": {"timeout": value},
        "inputs": [
            {"name": "embeddings", "shape": [1, 1, D], "datatype": "FP32", "data": [1.0] * D}
        ],
    }
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/small/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    message = json.loads(refused.value.read())["error"]
    assert f"request parameter 'timeout' {said}; expected microseconds" in message
