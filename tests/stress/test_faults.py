"""Engine faults: an ONNX Runtime call that fails fails its own batch alone, with INTERNAL and
no internals for the client, while metrics and the log say so; a model file that becomes
unreadable after start does not take the server down."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from service.client import AttentionClient
from service.frontend.attention_servicer import AttentionServicer
from service.frontend.handlers import add_servicer
from service.frontend.v2_servicer import InferenceServicer
from service.frontend.validation import InputLimits
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from service.settings import Settings
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from service.worker.engine.onnx_model import OnnxModel
from service.worker.engine.registry import ModelRegistry
from service.worker.engine.repository import discover
from tests.harness.planes import LocalPlane
from tests.harness.server_process import ServerProcess

D = 64
POISON = 1234.5
ENGINE_ERROR = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
    "MatMul node; weights at /secret/models/small/2/model.onnx"
)


class FailingRunner:
    """A Runner (service/worker/batching/protocol.py) around a real model: run() raises as a failing
    ONNX Runtime call would, for any batch holding a POISON value; else the model answers."""

    def __init__(self, model: OnnxModel) -> None:
        self._model = model
        self.key = model.key
        self.failures = 0

    def __getattr__(self, name: str) -> Any:  # spec, label, batch_caps, ...: the model's own
        return getattr(self._model, name)

    def run(
        self, embeddings: np.ndarray, key_padding_mask: np.ndarray, with_weights: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        if (embeddings == POISON).any():
            self.failures += 1
            raise RuntimeError(ENGINE_ERROR)
        return self._model.run(embeddings, key_padding_mask, with_weights)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _batch(
    attend: Any, infer: Any, xs: list[np.ndarray]
) -> list[tuple[str, str, np.ndarray | None]]:
    """Half the requests on each API, all at once; (code, details, output) per request."""

    async def one(i: int, x: np.ndarray) -> tuple[str, str, np.ndarray | None]:
        try:
            if i % 2 == 0:
                reply = await attend(
                    pb.AttendRequest(
                        model="small",
                        request_id=f"r{i}",
                        embeddings=pb.Tensor(shape=list(x.shape), data=x.tobytes()),
                    ),
                    timeout=30,
                )
                return "OK", "", np.frombuffer(reply.output.data, np.float32).reshape(x.shape)
            request = v2.ModelInferRequest(
                model_name="small", id=f"r{i}", raw_input_contents=[x.tobytes()]
            )
            request.inputs.add(name="embeddings", datatype="FP32", shape=[1, *x.shape])
            answer = await infer(request, timeout=30)
            out = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(x.shape)
            return "OK", "", out
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details() or "", None

    return await asyncio.gather(*(one(i, x) for i, x in enumerate(xs)))


async def _scenario(model: OnnxModel, runner: FailingRunner) -> tuple[list, list]:
    # A batch closes at 4 sequences: each group of four shares one ONNX Runtime call.
    batcher = Batcher(BatchLimits(max_batch_size=4, max_queue_delay_s=30, max_queue_size=64))
    registry = ModelRegistry([runner], default_model="small")  # type: ignore[list-item]
    settings = Settings(max_batch_size=4, max_seq_len=64)
    plane = LocalPlane(registry, batcher)
    server = grpc.aio.server()
    add_servicer(
        server,
        attention_pb2_grpc.add_AttentionServiceServicer_to_server,
        AttentionServicer(plane, InputLimits(64, 4)),
    )
    add_servicer(
        server,
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
        InferenceServicer(plane, settings, lambda: True),
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await batcher.start()
    rng = np.random.default_rng(0)
    poisoned = [rng.standard_normal((5, D), np.float32) for _ in range(4)]
    poisoned[1][2, 3] = POISON
    clean = [rng.standard_normal((5, D), np.float32) for _ in range(4)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            attend = attention_pb2_grpc.AttentionServiceStub(channel).Attend
            infer = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
            failed = await _batch(attend, infer, poisoned)
            after = await _batch(attend, infer, clean)
    finally:
        await batcher.stop()
        await server.stop(None)
    expected = [model.run(x[None], np.zeros((1, 5), bool), False)[0][0] for x in clean]
    return failed, list(zip(after, expected, strict=True))


def test_a_failing_engine_call_fails_its_own_batch_alone(
    model_repository: Path, caplog: pytest.LogCaptureFixture, figures
) -> None:
    files = next(f for f in discover(model_repository) if (f.name, f.version) == ("small", 2))
    model = OnnxModel(files, ["CPUExecutionProvider"], 1)
    runner = FailingRunner(model)

    def internal() -> float:
        return sum(
            _sample("attention_requests_total", model="small", api=api, code="INTERNAL")
            for api in ("attention", "v2")
        )

    before = (_sample("attention_batch_failures_total", model="small"), internal())
    with caplog.at_level(logging.ERROR):
        failed, after = asyncio.run(_scenario(model, runner))
    failures = _sample("attention_batch_failures_total", model="small") - before[0]
    internal_codes = internal() - before[1]
    figures(
        {
            "poisoned batch": [code for code, _, _ in failed],
            "next batch": [code for (code, _, _), _ in after],
            "client message": failed[0][1],
            "batch_failures_total": failures,
            "requests_total INTERNAL": internal_codes,
        }
    )
    assert runner.failures == 1  # one ONNX Runtime call, holding all four requests
    assert [code for code, _, _ in failed] == ["INTERNAL"] * 4
    for i, (_, details, _) in enumerate(failed):
        assert details == f"internal error; request_id='r{i}' is in the server log"
    for (code, _, output), expected in after:
        assert code == "OK"
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    assert (failures, internal_codes) == (1, 4)
    logged = caplog.text
    assert "batch of 4 requests on small/2 failed" in logged
    assert "RUNTIME_EXCEPTION" in logged  # the cause, with its traceback, in the log only
    assert all(f"request_id='r{i}'" in logged for i in range(4))


@pytest.mark.usefixtures("grpc_gateway")  # calls the gateway answers itself, with and without
def test_a_model_file_unreadable_after_start_does_not_stop_the_server(
    model_repository: Path, tmp_path: Path, figures
) -> None:
    shutil.copytree(model_repository / "small" / "2", tmp_path / "small" / "2")
    version = tmp_path / "small" / "2"
    x = np.random.default_rng(1).standard_normal((6, D)).astype(np.float32)
    server = ServerProcess(tmp_path, "--batch-cap-budget-s", "0")
    with server, AttentionClient(server.target) as client:
        before = client.attend(x, model="small", return_attention_weights=True)
        (version / "model.onnx").unlink()
        for path in version.iterdir():
            path.chmod(0)
        version.chmod(0)
        try:
            after = [
                client.attend(x, model="small", return_attention_weights=w) for w in (False, True)
            ]
            serving = client.is_serving()
        finally:
            version.chmod(0o755)
            for path in version.iterdir():
                path.chmod(0o644)
        assert server.terminate() == 0, server.log
    figures({"calls after the files went": "OK", "health": serving, "exit code": 0})
    for answer in after:
        np.testing.assert_allclose(answer.output, before.output, rtol=1e-6, atol=1e-6)
    assert after[1].attention_weights is not None
    assert "Traceback" not in server.log, server.log
    assert serving
