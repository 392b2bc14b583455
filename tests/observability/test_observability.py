"""Structured logs, run-time log settings and process metrics of a real server: two front
ends (with their gateways, and without), JSON logs, the logging group restricted; real gRPC
(tritonclient) and HTTP on loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from bench.harness import wait_for
from export.pipeline import ExportRequest, run_export
from tests.harness.server_process import ServerProcess, child_pids, rss_bytes

KEY_HEADER, KEY = "x-log-key", "let-me-in"
WITH_KEY = {KEY_HEADER: KEY}
PYTHON_ROLES = {"supervisor", "worker", "frontend-0", "frontend-1"}
GATEWAY_ROLES = {"gateway-0", "gateway-1"}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
D = 32


@pytest.fixture(scope="module")
def roles(grpc_gateway: str) -> set[str]:
    """The processes of the server, by the names their logs and metrics carry."""
    return PYTHON_ROLES | (GATEWAY_ROLES if grpc_gateway == "on" else set())


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    run_export(ExportRequest(name="tiny", embed_dim=D, num_heads=2, out=root))
    return root


@pytest.fixture(scope="module")
def server(repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    flags = (
        "--frontends",
        "2",
        "--log-format",
        "json",
        "--default-model",
        "tiny",
        "--restricted-api",
        f"logging:{KEY_HEADER}={KEY}",
    )
    with ServerProcess(repository, *flags, http=True) as process:
        yield process


def _lines(server: ServerProcess, start: int = 0) -> list[dict[str, Any]]:
    """The server's log lines from start on, each parsed (a line that is not a JSON object
    fails the test that reads it)."""
    parsed = []
    for line in server.lines[start:]:
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON log line: {line!r}")
        assert isinstance(record, dict), line
        parsed.append(record)
    return parsed


def _rest(
    server: ServerProcess, path: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _infer_rest(server: ServerProcess, request_id: str = "") -> None:
    data = np.ones((1, 4, D), np.float32)
    body = {
        "id": request_id,
        "inputs": [
            {
                "name": "embeddings",
                "shape": list(data.shape),
                "datatype": "FP32",
                "data": data.ravel().tolist(),
            }
        ],
    }
    status, answer = _rest(server, "/v2/models/tiny/infer", body)
    assert status == 200, answer


def _infer_grpc(server: ServerProcess, calls: int = 1) -> None:
    """Plain ModelInfer calls on a new connection (answered by a gateway where there is one)."""
    with triton.InferenceServerClient(server.target) as client:
        data = triton.InferInput("embeddings", [1, 4, D], "FP32")
        data.set_data_from_numpy(np.ones((1, 4, D), np.float32))
        for _ in range(calls):
            client.infer("tiny", [data], headers={"traceparent": TRACEPARENT})
        client.get_inference_statistics("tiny")  # through a gateway and a front end to the worker


def test_every_process_writes_json_lines_with_the_fields(
    server: ServerProcess, roles: set[str]
) -> None:
    _infer_grpc(server)
    records = _lines(server)
    assert {record["process"] for record in records} == roles
    for record in records:
        assert {"time", "level", "process", "logger", "message"} <= set(record), record
        assert record["level"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}, record
        assert record["time"].endswith("Z"), record  # RFC 3339 in UTC
        assert datetime.fromisoformat(record["time"]).utcoffset() is not None
        assert isinstance(record["message"], str), record
        assert record["logger"], record
    gateways = [r for r in records if r["process"].startswith("gateway-")]
    assert {r["logger"] for r in gateways} <= {"gateway"}


def test_grpc_cores_own_lines_are_json_lines_of_the_front_end(server: ServerProcess) -> None:
    """gRPC core writes its own lines to standard error (here: a gzip call it refuses, the
    gateway passing compressed calls to Python); they reach the log as JSON records of the
    front end, never as bare text."""
    start = len(server.lines)
    compressed = grpc.insecure_channel(server.target, compression=grpc.Compression.Gzip)
    with compressed:
        live = compressed.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=lambda _: b"",
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.RpcError) as refused:
            live(None, timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, refused.value

    def relayed() -> list[dict[str, Any]]:
        return [r for r in _lines(server, start) if r["logger"] == "grpc.core"]

    wait_for(relayed, what="gRPC core's line about the gzip call")
    record = relayed()[0]
    assert record["process"].startswith("frontend-"), record
    assert record["level"] == "ERROR", record
    assert "Compression algorithm 'gzip' is disabled" in record["message"], record


def test_a_level_set_through_v2_logging_reaches_the_worker_and_the_gateways(
    server: ServerProcess, roles: set[str]
) -> None:
    status, settings = _rest(server, "/v2/logging", headers=WITH_KEY)
    assert status == 200, settings
    assert settings == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "json",
    }
    start = len(server.lines)
    status, settings = _rest(server, "/v2/logging", {"log_verbose_level": 1}, WITH_KEY)
    assert status == 200, settings
    assert settings["log_verbose_level"] == 1, settings

    def debug_from(*processes: str) -> Callable[[], bool]:
        def seen() -> bool:
            _infer_grpc(server)
            _infer_rest(server, request_id="log-test-7")
            debug = {r["process"] for r in _lines(server, start) if r["level"] == "DEBUG"}
            return all(any(p.startswith(process) for p in debug) for process in processes)

        return seen

    # Each process says when it has taken a change (a quick second change may overtake one).
    wait_for(
        lambda: _took(server, start, "DEBUG") >= roles,
        what=lambda: f"every process taking DEBUG (only {_took(server, start, 'DEBUG')} did)",
        timeout_s=30,
    )
    gateway = ("gateway-",) if roles >= GATEWAY_ROLES else ()
    wait_for(
        debug_from("worker", "frontend-", *gateway),
        what="DEBUG lines from the worker, a front end and a gateway (if any)",
        timeout_s=30,
    )

    # Inside a request a line carries what is known of it: the gateway the caller's trace
    # id, the front end the request's id (and the trace id only with --tracing on).
    def carried(process: str, field: str, value: str) -> Callable[[], bool]:
        return lambda: any(
            r.get(field) == value and r["process"].startswith(process)
            for r in _lines(server, start)
        )

    if gateway:
        trace_id = TRACEPARENT[3:35]
        wait_for(
            carried("gateway-", "trace_id", trace_id), what="a gateway's line with the trace id"
        )
    wait_for(
        carried("frontend-", "request_id", "log-test-7"),
        what="a front end's line with the request id",
        timeout_s=30,
    )

    status, settings = _rest(server, "/v2/logging", {"log_verbose_level": 0}, WITH_KEY)
    assert status == 200
    assert settings["log_verbose_level"] == 0
    assert settings["log_info"]
    # None logs DEBUG after saying it has taken INFO.
    wait_for(
        lambda: _took(server, start, "INFO") >= roles,
        what=lambda: f"every process taking INFO (only {_took(server, start, 'INFO')} did)",
        timeout_s=30,
    )
    _infer_grpc(server, calls=3)
    _infer_rest(server, request_id="log-test-8")
    # A line written after those calls were answered: whatever they logged is before it.
    marker = len(server.lines)
    _rest(server, "/v2/logging", {"log_info": True}, WITH_KEY)
    wait_for(
        lambda: any("set by" in r["message"] for r in _lines(server, marker)),
        what="the marker line",
        timeout_s=30,
    )
    since: dict[str, bool] = {}
    for record in _lines(server, start):
        if record["message"].startswith("log settings") and "level INFO" in record["message"]:
            since[record["process"]] = True
        elif record["level"] == "DEBUG":
            assert not since.get(record["process"]), f"DEBUG after INFO was taken: {record}"


def _took(server: ServerProcess, start: int, level: str) -> set[str]:
    """The processes that logged taking level since start."""
    return {
        r["process"]
        for r in _lines(server, start)
        if r["message"].startswith("log settings") and f"level {level}," in r["message"]
    }


def test_log_settings_over_grpc_as_tritonclient_sends_them(server: ServerProcess) -> None:
    with triton.InferenceServerClient(server.target) as client:
        now = client.get_log_settings(headers=WITH_KEY, as_json=True)["settings"]
        assert now["log_format"] == {"string_param": "json"}
        assert now["log_verbose_level"] == {"uint32_param": 0}
        assert "logging" in client.get_server_metadata().extensions
        changed = client.update_log_settings({"log_info": False}, headers=WITH_KEY, as_json=True)
        assert changed["settings"]["log_info"] == {"bool_param": False}
        assert changed["settings"]["log_warning"] == {"bool_param": True}
        for wrong in ({"log_info": None}, {"log_format": "xml"}, {"log_file": "/tmp/x"}):
            with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT"):
                client.update_log_settings(wrong, headers=WITH_KEY)
        back = client.update_log_settings({"log_info": True}, headers=WITH_KEY, as_json=True)
        assert back["settings"]["log_info"] == {"bool_param": True}
    status, answer = _rest(server, "/v2/logging", {"log_warning": "yes"}, WITH_KEY)
    assert status == 400
    assert "log_warning" in answer["error"]


def test_the_logging_group_refuses_without_its_key(server: ServerProcess) -> None:
    for headers in ({}, {KEY_HEADER: "wrong"}):
        for body in (None, {"log_verbose_level": 1}):
            status, answer = _rest(server, "/v2/logging", body, headers)
            assert status == 403, answer
            assert KEY_HEADER in answer["error"]
            assert KEY not in answer["error"]
        with triton.InferenceServerClient(server.target) as client:
            with pytest.raises(InferenceServerException, match="PERMISSION_DENIED"):
                client.update_log_settings({"log_verbose_level": 1}, headers=headers)
            with pytest.raises(InferenceServerException, match="PERMISSION_DENIED"):
                client.get_log_settings(headers=headers)
    assert _rest(server, "/v2/logging", headers=WITH_KEY)[1]["log_verbose_level"] == 0
    denied = server.metric("attention_restricted_api_denials_total", group="logging")
    assert denied >= 8


def _role(started: str) -> str:
    """frontend-K-gateway, as the front end logs its gateway's start, is gateway-K."""
    return "gateway-" + started.split("-")[1] if started.endswith("-gateway") else started


def _by_process(server: ServerProcess, name: str) -> dict[str, float]:
    return {
        dict(labels)["process"]: value
        for (sample, labels), value in server.metrics().items()
        if sample == name
    }


def test_every_process_has_cpu_and_memory_series_that_move(
    server: ServerProcess, roles: set[str]
) -> None:
    before = _by_process(server, "attention_process_cpu_seconds_total")
    assert set(before) == roles
    memory = _by_process(server, "attention_process_resident_memory_bytes")
    assert set(memory) == roles
    pids = {_role(name): pid for name, pid in child_pids(server).items()}
    pids["supervisor"] = server.process.pid
    for role, pid in pids.items():
        # The series is the process's resident memory (it changes a little as it runs).
        assert 0.5 < memory[role] / rss_bytes(pid) < 2, (role, memory[role], rss_bytes(pid))

    def moved() -> bool:
        # Work for every process: gRPC calls answered by the gateways (if any), REST calls by
        # the Python front ends, batches for the worker, scrapes for the supervisor.
        for _ in range(4):
            _infer_grpc(server, calls=20)
            _infer_rest(server)
        now = _by_process(server, "attention_process_cpu_seconds_total")
        return all(now[role] > before[role] for role in roles)

    wait_for(moved, what="every process's CPU seconds moving", timeout_s=120)


def test_no_gpu_series_without_a_gpu(server: ServerProcess) -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a GPU is present: bench/gpu.sh checks the GPU series")
    assert not [name for name, _ in server.metrics() if name.startswith("attention_gpu_")]
