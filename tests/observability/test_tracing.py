"""--tracing on: spans decoded by a real OTLP/gRPC receiver, for calls the gateway answers
and calls Python answers alike; an unreachable collector costs the requests nothing."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from bench.harness import silent_listener, wait_for
from export.pipeline import ExportRequest, run_export
from service.client import attend_request
from service.generated.attention.v1 import attention_pb2_grpc
from service.generated.inference import grpc_service_pb2, grpc_service_pb2_grpc
from tests.harness.h2_raw import RawGrpc
from tests.harness.otlp_receiver import OtlpReceiver, attributes
from tests.harness.server_process import ServerProcess, behind_gateway, child_pids, rss_bytes

pytestmark = pytest.mark.usefixtures("grpc_gateway")
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
def traced(repository: Path, grpc_gateway: str) -> Iterator[tuple[ServerProcess, OtlpReceiver]]:
    with OtlpReceiver() as receiver:
        flags = (
            "--default-model",
            "small",
            "--tracing",
            "on",
            "--max-queue-delay-ms",
            "200",
            "--max-batch-size",
            "2",
            "--max-padding-ratio",  # a batch of lengths 4 and 2 (0.25 padded) on any device
            "0.5",
        )
        with ServerProcess(repository, *flags, env=_otel_env(receiver.endpoint), http=True) as s:
            # Tracing keeps the fast path: the gateway serves the port when it is on.
            assert behind_gateway(s) == (grpc_gateway == "on")
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


def test_a_calls_log_line_carries_its_trace_span_and_request_ids(
    repository: Path, grpc_gateway: str
) -> None:
    """JSON logs, DEBUG: the line that ends a call (the gateway's, or the front end's without
    it) names the call's trace, its server span and its request id. Before: the gateway's
    had the trace id alone, the front end's the request id alone (written after its span)."""
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    flags = ("--default-model", "small", "--tracing", "on", "--log-format", "json")
    with OtlpReceiver() as receiver:
        env = {**_otel_env(receiver.endpoint), "ATTENTION_LOG_LEVEL": "DEBUG"}
        with ServerProcess(repository, *flags, env=env) as server:
            client = triton_grpc.InferenceServerClient(server.target)
            tensor = triton_grpc.InferInput("embeddings", [1, 3, D], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 3, D), np.float32))
            client.infer(
                "small",
                [tensor],
                request_id="rid-77",
                headers={"traceparent": _traceparent(trace_id)},
            )
            client.close()
            spans = receiver.wait_for(lambda got: len(_calls(_of_trace(got, trace_id))) >= 1)
            call = _calls(_of_trace(spans, trace_id))[0]
            ended = [
                record
                for record in (json.loads(line) for line in server.lines if line.startswith("{"))
                if " ModelInfer ended OK" in record["message"]
            ]
    answered_by = "gateway-" if grpc_gateway == "on" else "frontend-"
    assert any(
        record["process"].startswith(answered_by)
        and record.get("trace_id") == trace_id
        and record.get("span_id") == call.span_id.hex()
        and record.get("request_id") == "rid-77"
        for record in ended
    ), ended


def test_a_streams_end_is_logged_with_the_requests_it_read(
    repository: Path, grpc_gateway: str
) -> None:
    """DEBUG: a stream ends with a line as a unary call does (the gateway's, or the front
    end's without it): how it ended, after how long, and how many requests it read. Before:
    none, on either path."""
    # A lone request waits in the queue (a second at most), so the cancel below comes while
    # the stream still owes its answer.
    batching = ("--max-queue-delay-ms", "1000", "--max-batch-size", "8")
    flags = ("--default-model", "small", "--log-format", "json", *batching)
    env = {"ATTENTION_LOG_LEVEL": "DEBUG"}
    request = grpc_service_pb2.ModelInferRequest(model_name="small")
    request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 3, D])
    request.raw_input_contents.append(np.ones((1, 3, D), np.float32).tobytes())
    with (
        ServerProcess(repository, *flags, env=env) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter([request] * 3), timeout=30))
        assert [answer.error_message for answer in answers] == [""] * 3

        def ended() -> list[dict[str, str]]:
            records = (json.loads(line) for line in server.lines if line.startswith("{"))
            return [r for r in records if "ModelStreamInfer ended" in r["message"]]

        wait_for(ended, what="the stream's end line")
        # Cancelled by its client while its one request waits in the queue.
        held = threading.Event()

        def one_then_wait() -> Iterator[grpc_service_pb2.ModelInferRequest]:
            yield request
            held.wait(30)

        cancelled = stub.ModelStreamInfer(one_then_wait(), timeout=30)
        server.wait_metric("attention_queue_depth_requests", 1)
        cancelled.cancel()
        held.set()
        wait_for(lambda: len(ended()) == 2, what="the cancelled stream's end line")
    answered_by = "gateway-" if grpc_gateway == "on" else "frontend-"
    whole, cut = ended()
    assert {whole["process"], cut["process"]} == {whole["process"]}, (whole, cut)
    assert whole["process"].startswith(answered_by), whole
    assert re.fullmatch(
        r"v2_stream ModelStreamInfer ended OK after \d+\.\d{6} s, 3 requests read",
        whole["message"],
    ), whole
    assert re.fullmatch(
        r"v2_stream ModelStreamInfer ended CANCELLED after \d+\.\d{6} s, 1 request read",
        cut["message"],
    ), cut


def _infer(server: ServerProcess, seq: int, headers: dict[str, str] | None = None) -> None:
    client = triton_grpc.InferenceServerClient(server.target)
    x = np.ones((1, seq, D), np.float32)
    tensor = triton_grpc.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client.infer("small", [tensor], headers=headers)
    client.close()


def _calls(spans, name: str = "inference.GRPCInferenceService/ModelInfer"):
    return [s for s in spans if s.name == name]


def test_a_call_without_a_traceparent_starts_its_own_trace(traced) -> None:
    server, receiver = traced
    _infer(server, seq=7)  # a length no other test sends: it finds this call's span

    def this_call(spans):
        return [s for s in _calls(spans) if attributes(s).get("attention.sequence_length") == 7]

    spans = receiver.wait_for(lambda got: len(this_call(got)) == 1)
    (call,) = this_call(spans)
    assert call.parent_span_id == b""
    assert call.trace_id != bytes(16)
    children = [s for s in spans if s.parent_span_id == call.span_id]
    assert sorted(s.name for s in children) == ["compute", "queue"]
    assert all(s.trace_id == call.trace_id for s in children)


def test_an_attend_call_is_traced_under_its_caller(traced) -> None:
    server, receiver = traced
    trace_id = "5" * 32
    with grpc.insecure_channel(server.target) as channel:
        attend = attention_pb2_grpc.AttentionServiceStub(channel).Attend
        attend(
            attend_request(np.ones((1, 4, D), np.float32), model="small"),
            metadata=[("traceparent", _traceparent(trace_id))],
            timeout=30,
        )
    spans = receiver.wait_for(lambda got: len(_of_trace(got, trace_id)) >= 3)
    (call,) = _calls(_of_trace(spans, trace_id), "attention.v1.AttentionService/Attend")
    assert call.parent_span_id.hex() == CALLER_SPAN
    assert attributes(call)["rpc.method"] == "Attend"
    assert attributes(call)["attention.code"] == "OK"
    compute = next(s for s in _of_trace(spans, trace_id) if s.name == "compute")
    assert call.span_id in [link.span_id for link in compute.links]


def test_a_caller_that_samples_nothing_gets_no_spans(traced) -> None:
    server, receiver = traced
    unsampled, marker = "6" * 32, "7" * 32
    _infer(server, seq=2, headers={"traceparent": f"00-{unsampled}-{CALLER_SPAN}-00"})
    _infer(server, seq=2, headers={"traceparent": _traceparent(marker)})
    # Spans are recorded in the order calls end: once the later call's are in, the
    # earlier call's would be.
    spans = receiver.wait_for(lambda got: len(_of_trace(got, marker)) >= 3)
    assert _of_trace(spans, unsampled) == []


def test_a_tracestate_that_is_not_utf8_loses_no_span(traced) -> None:
    """gRPC Python reads such a header as Latin-1 and the SDK drops the state: the call keeps
    its span (without the state), and so do the calls after it."""
    server, receiver = traced
    junk, after = "9" * 32, "a" * 32
    request = grpc_service_pb2.ModelInferRequest(model_name="small")
    request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 2, D])
    request.raw_input_contents.append(np.ones((1, 2, D), np.float32).tobytes())
    client = RawGrpc(int(server.target.rsplit(":", 1)[1]))
    try:
        for trace_id, state in ((junk, b"a=\xff\xfe"), (after, b"a=1")):
            metadata = {"traceparent": _traceparent(trace_id), "tracestate": state}
            stream = client.call(
                "/inference.GRPCInferenceService/ModelInfer",
                request.SerializeToString(),
                metadata=metadata,  # type: ignore[arg-type]
            )
            assert client.wait(stream).headers.get("grpc-status") == "0"
    finally:
        client.close()
    spans = receiver.wait_for(
        lambda got: len(_calls(_of_trace(got, junk))) == len(_calls(_of_trace(got, after))) == 1
    )
    assert _calls(_of_trace(spans, junk))[0].trace_state == ""
    assert _calls(_of_trace(spans, after))[0].trace_state == "a=1"


def test_a_refused_call_has_a_span_with_its_code(traced) -> None:
    server, receiver = traced
    trace_id = "8" * 32
    client = triton_grpc.InferenceServerClient(server.target)
    x = np.ones((1, 2, D + 1), np.float32)  # the wrong embedding size
    tensor = triton_grpc.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(triton_grpc.InferenceServerException):
        client.infer("small", [tensor], headers={"traceparent": _traceparent(trace_id)})
    client.close()
    spans = receiver.wait_for(lambda got: len(_calls(_of_trace(got, trace_id))) == 1)
    (call,) = _calls(_of_trace(spans, trace_id))
    assert attributes(call)["attention.code"] == "INVALID_ARGUMENT"
    assert attributes(call)["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_ratio_sampler_samples_the_trace_ids_the_sdk_would(repository: Path) -> None:
    """OTEL_TRACES_SAMPLER=traceidratio: a trace is sampled when its id's low 64 bits are
    below the SDK's bound, whichever process answers; roots are sampled at the ratio."""
    bound = round(0.25 * 2**64)  # opentelemetry.sdk.trace.sampling.TraceIdRatioBased
    ids = [f"{i:016x}{(i * 0x9E3779B97F4A7C15) % 2**64:016x}" for i in range(1, 41)]
    expected = {t for t in ids if int(t[16:], 16) < bound}
    assert 0 < len(expected) < len(ids)
    env = {
        **_otel_env(""),
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    with OtlpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        with ServerProcess(repository, "--default-model", "small", "--tracing", "on", env=env) as s:
            for trace_id in ids:
                _infer(s, seq=2, headers={"traceparent": _traceparent(trace_id)})
            roots = 200
            for _ in range(roots):
                _infer(s, seq=3)
            marker = "9" * 16 + "0" * 16  # low bits 0: sampled
            _infer(s, seq=2, headers={"traceparent": _traceparent(marker)})
            spans = receiver.wait_for(lambda got: len(_calls(_of_trace(got, marker))) == 1)
    sampled = {s.trace_id.hex() for s in _calls(spans)}
    assert sampled & set(ids) == expected
    sampled_roots = sum(
        attributes(s).get("attention.sequence_length") == 3 and s.parent_span_id == b""
        for s in _calls(spans)
    )
    # Binomial(200, 0.25): mean 50, standard deviation 6.1; five of them either side.
    assert 19 <= sampled_roots <= 81


def test_b3_and_jaeger_propagators_parent_the_servers_spans(repository: Path) -> None:
    """OTEL_PROPAGATORS=b3 (and jaeger), as docs/observability.md names them: Python serves
    the gRPC port and the caller's B3 headers parent the call's span. (The propagators were
    not installed: every call failed UNKNOWN, and REST, readiness too, answered 500.)"""
    b3_trace, uber_trace = "a" * 16 + "1" * 16, "b" * 16 + "2" * 16
    env = {**_otel_env(""), "OTEL_PROPAGATORS": "b3,jaeger"}
    with OtlpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        flags = ("--default-model", "small", "--tracing", "on")
        with ServerProcess(repository, *flags, env=env, http=True) as server:
            assert not behind_gateway(server)
            _infer(server, seq=2, headers={"b3": f"{b3_trace}-{CALLER_SPAN}-1"})
            _infer(server, seq=3, headers={"uber-trace-id": f"{uber_trace}:{CALLER_SPAN}:0:1"})
            with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready") as ready:
                assert ready.status == 200
            for trace_id in (b3_trace, uber_trace):
                spans = receiver.wait_for(lambda got, t=trace_id: len(_calls(_of_trace(got, t))))
                (call,) = _calls(_of_trace(spans, trace_id))
                assert call.parent_span_id.hex() == CALLER_SPAN


def test_a_propagator_not_installed_is_refused_at_start(repository: Path) -> None:
    env = {**_otel_env("http://127.0.0.1:9"), "OTEL_PROPAGATORS": "tracecontext,bogus"}
    server = ServerProcess(repository, "--default-model", "small", "--tracing", "on", env=env)
    assert server.process.wait(120) != 0
    assert "OTEL_PROPAGATORS='tracecontext,bogus': Propagator bogus not found" in server.log
    assert "the propagators installed are b3, b3multi, baggage, jaeger, tracecontext" in (
        server.log
    )
    assert "loading" not in server.log  # refused before the worker loads a model


def test_otel_sdk_disabled_turns_every_path_off(repository: Path) -> None:
    """OTEL_SDK_DISABLED=true: REST's spans stopped, but the gateway still sampled its calls
    (and Python made their spans) and streams' messages were traced."""
    env = {**_otel_env("http://127.0.0.1:9"), "OTEL_SDK_DISABLED": "true"}
    flags = ("--default-model", "small", "--tracing", "on")
    with ServerProcess(repository, *flags, env=env) as server:
        assert "OTEL_SDK_DISABLED=true: no spans are made" in server.log
        _infer(server, seq=2, headers={"traceparent": _traceparent(TRACE_ID)})
        gateways = [pid for name, pid in child_pids(server).items() if name.endswith("-gateway")]
        for pid in gateways:
            assert b"--trace-sampler" not in Path(f"/proc/{pid}/cmdline").read_bytes()


def _rest_infer(server: ServerProcess, trace_id: str, seq: int) -> None:
    body = {
        "inputs": [
            {
                "name": "embeddings",
                "shape": [1, seq, D],
                "datatype": "FP32",
                "data": [0.5] * (seq * D),
            }
        ]
    }
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/small/infer",
        data=json.dumps(body).encode(),
        headers={"traceparent": _traceparent(trace_id)},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200


def test_rest_calls_batched_together_link_through_the_batch_s_leader(traced) -> None:
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
    computes = {t: next(s for s in _of_trace(spans, t) if s.name == "compute") for t in calls}
    for compute in computes.values():
        assert attributes(compute)["attention.batch_size"] == 2
        assert attributes(compute)["attention.batch_padding_ratio"] == pytest.approx(0.25)
        assert (
            attributes(compute)["attention.batch_id"]
            == attributes(computes[first])["attention.batch_id"]
        )
    # The batch's leader links to both calls; the other request's compute to the leader's.
    links = {t: [link.span_id for link in c.links] for t, c in computes.items()}
    leader = first if len(links[first]) == 2 else second
    other = second if leader == first else first
    assert set(links[leader]) == {c.span_id for c in calls.values()}
    assert links[other] == [calls[leader].span_id]


def test_stream_gets_a_span_per_message(traced) -> None:
    server, receiver = traced
    trace_id = "3" * 32
    client = triton_grpc.InferenceServerClient(server.target)
    answers: list[object] = []
    client.start_stream(
        callback=lambda result, error: answers.append(error or result),
        headers={"traceparent": _traceparent(trace_id)},
    )
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


@pytest.mark.gateway_off_heavy
def test_an_unresponsive_collector_neither_slows_nor_grows_the_server(repository: Path) -> None:
    # A collector that accepts connections and never answers: each export waits its timeout.
    with silent_listener() as port:
        endpoint = f"http://127.0.0.1:{port}"
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
                    client.infer(
                        "small", [tensor], headers={"traceparent": _traceparent(f"{i + 1:032x}")}
                    )
                    slowest = max(slowest, time.monotonic() - started)
                return slowest

            burst(100)  # the span queue is full from here on
            settled = rss_bytes(server.process.pid)
            slowest = burst(400)
            grown = rss_bytes(server.process.pid) - settled
            client.close()
            assert slowest < 1.0, f"a request took {slowest:.2f}s with the collector hanging"
            assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB over 400 traced requests"
