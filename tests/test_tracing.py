"""--tracing on: spans decoded by a real OTLP/gRPC receiver; an unreachable collector costs
the requests nothing."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from export.pipeline import ExportRequest, run_export
from tests.otlp_receiver import OtlpReceiver, attributes
from tests.server_process import ServerProcess

D, H = 64, 4
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("traced-models")
    run_export(ExportRequest(name="small", embed_dim=D, num_heads=H, out=root))
    return root


def _otel_env(endpoint: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "attention-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: the test polls, it need not wait 5 s
    }


@pytest.fixture(scope="module")
def traced(repository: Path) -> Iterator[tuple[ServerProcess, OtlpReceiver]]:
    with OtlpReceiver() as receiver:
        flags = ("--default-model", "small", "--tracing", "on", "--max-queue-delay-ms", "200",
                 "--max-batch-size", "2")  # fmt: skip
        with ServerProcess(repository, *flags, env=_otel_env(receiver.endpoint), http=True) as s:
            yield s, receiver


def _traceparent(trace_id: str, span: str = CALLER_SPAN) -> str:
    return f"00-{trace_id}-{span}-01"


def _of_trace(spans, trace_id: str):
    return [s for s in spans if s.trace_id.hex() == trace_id]


def test_grpc_call_has_queue_and_compute_spans_in_the_callers_trace(traced) -> None:
    server, receiver = traced
    client = triton_grpc.InferenceServerClient(server.target)
    x = np.ones((2, 3, D), np.float32)
    tensor = triton_grpc.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client.infer("small", [tensor], headers={"traceparent": _traceparent(TRACE_ID)})
    client.close()
    spans = receiver.wait_for(lambda got: len(_of_trace(got, TRACE_ID)) >= 3)
    by_name = {s.name: s for s in _of_trace(spans, TRACE_ID)}
    call = by_name["inference.GRPCInferenceService/ModelInfer"]
    assert call.parent_span_id.hex() == CALLER_SPAN
    assert call.kind == call.SPAN_KIND_SERVER
    for child in ("queue", "compute"):
        assert by_name[child].parent_span_id == call.span_id
    queue, compute = by_name["queue"], by_name["compute"]
    assert call.start_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= compute.start_time_unix_nano + 1000
    assert compute.end_time_unix_nano <= call.end_time_unix_nano
    facts = attributes(compute)
    assert facts["attention.model"] == "small"
    assert facts["attention.model_version"] == 1
    assert facts["attention.sequences"] == 2
    assert facts["attention.sequence_length"] == 3
    assert facts["attention.batch_size"] == 2
    assert "attention.batch_padding_ratio" in facts
    assert [link.span_id for link in compute.links] == [call.span_id]
    assert attributes(call)["rpc.grpc.status_code"] == 0
    assert receiver.service_names == {"attention-under-test"}


def _rest_infer(server: ServerProcess, trace_id: str, seq: int) -> None:
    body = {"inputs": [{"name": "embeddings", "shape": [1, seq, D], "datatype": "FP32",
                        "data": [0.5] * (seq * D)}]}  # fmt: skip
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/small/infer",
        data=json.dumps(body).encode(),
        headers={"traceparent": _traceparent(trace_id)},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200


def test_rest_calls_batched_together_link_one_compute_to_both(traced) -> None:
    server, receiver = traced
    first, second = "1" * 32, "2" * 32
    # --max-queue-delay-ms 200 and --max-batch-size 2: the two requests share a batch.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda args: _rest_infer(server, *args), [(first, 4), (second, 2)]))
    spans = receiver.wait_for(lambda got: all(len(_of_trace(got, t)) >= 3 for t in (first, second)))
    calls = {
        t: next(s for s in _of_trace(spans, t) if s.name.startswith("POST "))
        for t in (first, second)
    }
    assert calls[first].name == "POST /v2/models/{model}/infer"
    assert attributes(calls[first])["http.response.status_code"] == 200
    compute = next(s for s in _of_trace(spans, first) if s.name == "compute")
    assert attributes(compute)["attention.batch_size"] == 2
    assert attributes(compute)["attention.batch_padding_ratio"] == pytest.approx(0.25)
    assert {link.span_id for link in compute.links} == {c.span_id for c in calls.values()}


def test_stream_gets_a_span_per_message(traced) -> None:
    server, receiver = traced
    trace_id = "3" * 32
    client = triton_grpc.InferenceServerClient(server.target)
    answers: list[object] = []
    client.start_stream(callback=lambda result, error: answers.append(error or result),
                        headers={"traceparent": _traceparent(trace_id)})  # fmt: skip
    x = np.ones((1, 2, D), np.float32)
    for _ in range(2):
        tensor = triton_grpc.InferInput("embeddings", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        client.async_stream_infer("small", [tensor])
    spans = receiver.wait_for(
        lambda got: sum(s.name.endswith("/ModelStreamInfer") for s in _of_trace(got, trace_id)) >= 2
    )
    client.stop_stream()
    client.close()
    messages = [s for s in _of_trace(spans, trace_id) if s.name.endswith("/ModelStreamInfer")]
    assert len({m.span_id for m in messages}) == 2


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_unresponsive_collector_neither_slows_nor_grows_the_server(repository: Path) -> None:
    # A collector that accepts connections and never answers: each export waits its timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        flags = ("--default-model", "small", "--tracing", "on", "--tracing-max-queue-spans", "64")
        env = {**_otel_env(endpoint), "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "16"}
        with ServerProcess(repository, *flags, env=env) as server:
            client = triton_grpc.InferenceServerClient(server.target)
            x = np.ones((1, 8, D), np.float32)
            tensor = triton_grpc.InferInput("embeddings", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)

            def burst(n: int) -> float:
                slowest = 0.0
                for i in range(n):
                    started = time.monotonic()
                    client.infer("small", [tensor],
                                 headers={"traceparent": _traceparent(f"{i + 1:032x}")})  # fmt: skip
                    slowest = max(slowest, time.monotonic() - started)
                return slowest

            burst(100)  # the span queue is full from here on
            settled = _rss_bytes(server.process.pid)
            slowest = burst(400)
            grown = _rss_bytes(server.process.pid) - settled
            client.close()
            assert slowest < 1.0, f"a request took {slowest:.2f}s with the collector hanging"
            assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB over 400 traced requests"
