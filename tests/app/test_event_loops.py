"""Both event loops serve alike. The suite runs on uvloop (--event-loop auto, the server
installs it); this module runs the worker and front ends on asyncio's own loop, as a server
installed without uvloop does, with the gateway on and off: every API answers exactly."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http

from service.client import AttendResult, AttentionClient
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import ServerProcess

pytestmark = pytest.mark.usefixtures("grpc_gateway")

D, H = 512, 8


@pytest.fixture(scope="module")
def asyncio_server(model_repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_repository, "--event-loop", "asyncio", http=True) as process:
        yield process
    assert process.process.returncode == 0, process.log


@pytest.fixture(scope="module")
def reference():
    return layer_for(D, H)


def test_the_log_names_the_loop_that_runs(asyncio_server: ServerProcess) -> None:
    assert "event loop of the worker and front ends: asyncio" in asyncio_server.log


def test_concurrent_attend_calls_and_a_stream_equal_torch(
    asyncio_server: ServerProcess, reference
) -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((seq, D), dtype=np.float32) for seq in (1, 7, 16, 33) * 4]
    with AttentionClient(asyncio_server.target) as client:
        with ThreadPoolExecutor(8) as pool:  # batched together by the worker
            results = list(pool.map(lambda x: client.attend(x), inputs))
        streamed = {
            r.request_id: r
            for r in client.attend_stream(
                [(x, {"request_id": str(i)}) for i, x in enumerate(inputs)],
                return_attention_weights=True,
            )
        }
    for i, (x, result) in enumerate(zip(inputs, results, strict=True)):
        want_output, want_weights = attend_alone(reference, x)
        np.testing.assert_allclose(result.output, want_output, atol=1e-5, rtol=0)
        answer = streamed[str(i)]
        assert isinstance(answer, AttendResult), answer
        assert answer.attention_weights is not None
        np.testing.assert_allclose(answer.output, want_output, atol=1e-5, rtol=0)
        np.testing.assert_allclose(answer.attention_weights, want_weights, atol=1e-5, rtol=0)


def test_v2_over_grpc_and_rest_equal_torch(asyncio_server: ServerProcess, reference) -> None:
    x = np.random.default_rng(4).standard_normal((2, 9, D), dtype=np.float32)
    want_output, _ = attend_alone(reference, x)
    tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with triton.InferenceServerClient(asyncio_server.target) as v2:
        answer = v2.infer("mha", [tensor])
    np.testing.assert_allclose(answer.as_numpy("output"), want_output, atol=1e-5, rtol=0)

    rest_tensor = triton_http.InferInput("embeddings", list(x.shape), "FP32")
    rest_tensor.set_data_from_numpy(x, binary_data=True)
    rest = triton_http.InferenceServerClient(asyncio_server.http_url)
    try:
        answer_rest = rest.infer("mha", [rest_tensor])
    finally:
        rest.close()
    np.testing.assert_allclose(answer_rest.as_numpy("output"), want_output, atol=1e-5, rtol=0)
