"""The benchmark's h2load rows: the request frame, h2load's output read back (captured runs in
tests/fixtures/h2load), the checks that catch gRPC errors h2load counts as successes, the
targets and the CPU table, and real runs against a real server on loopback.

The real runs need h2load (Debian's nghttp2-client); without it they skip, and
ATTENTION_REQUIRE_H2LOAD=1 (set by .ci/run, which installs it) turns that skip into a
failure."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from bench import h2load, h2load_report, ratios, report, scenarios
from bench.echo_model import write_repository
from bench.h2load_output import answers_short, log_figures, parse_log, parse_output, seconds
from bench.launcher import REPO_ROOT, Pinning, Service, built
from bench.payloads import build_payloads
from bench.runner import BenchConfig, Runner
from bench.stats import Lengths
from service.generated.inference import grpc_service_pb2 as v2
from tests.harness.server_process import ServerProcess, child_pids

FIXTURES = Path(__file__).parents[1] / "fixtures" / "h2load"
FLOOR_ANSWER_BYTES = 1056  # the bare gRPC server's answer to the fixtures' request
REQUIRED = os.environ.get("ATTENTION_REQUIRE_H2LOAD") == "1"
D = 16  # the echo model's d in the real runs


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# -- the request frame ----------------------------------------------------------------------


def test_frame_is_the_load_generators_request_length_prefixed() -> None:
    message = h2load.request_message(16, 8, "mha")
    assert (
        message
        == build_payloads(
            "v2", Lengths(16, 16), embed_dim=8, sequences=1, weights_fraction=0.0, model="mha"
        )[16, False].body
    )
    body = h2load.frame(message)
    assert body[0] == 0  # not compressed
    assert int.from_bytes(body[1:5], "big") == len(message) == len(body) - 5
    request = v2.ModelInferRequest.FromString(h2load.unframe(body))
    assert request.model_name == "mha"
    assert [(i.name, i.datatype, list(i.shape)) for i in request.inputs] == [
        ("embeddings", "FP32", [1, 16, 8])
    ]
    assert len(request.raw_input_contents[0]) == 16 * 8 * 4
    assert not request.outputs  # output only: no weights asked for
    for broken in (b"\x01" + body[1:], body[:-1], b"\x00\x00"):
        with pytest.raises(ValueError, match=r"gRPC message|prefix says"):
            h2load.unframe(broken)


def test_command_posts_the_frame_as_a_grpc_call(tmp_path: Path) -> None:
    shape = h2load.Shape(1, 64)
    argv = h2load.command(
        "h2load",
        "127.0.0.1:8001",
        tmp_path / "body.bin",
        shape,
        requests=5000,
        log_file=tmp_path / "log.tsv",
    )
    assert argv[:3] == ["h2load", "-n", "5000"]
    pairs = list(itertools.pairwise(argv))
    assert ("-c", "1") in pairs
    assert ("-m", "64") in pairs
    assert ("-d", str(tmp_path / "body.bin")) in pairs
    assert ("-H", "content-type: application/grpc") in pairs
    assert ("-H", "te: trailers") in pairs
    assert f"--log-file={tmp_path / 'log.tsv'}" in argv
    assert argv[-1] == "http://127.0.0.1:8001/inference.GRPCInferenceService/ModelInfer"
    timed = h2load.command("h2load", "h:1", tmp_path / "b", shape, duration_ms=1500)
    assert timed[1:3] == ["-D", "1500ms"]
    assert shape.label == "c=1 m=64"
    assert h2load.shapes(64) == (h2load.Shape(1, 1), shape)


# -- h2load's output, read back ---------------------------------------------------------------


def test_summary_of_a_clean_run() -> None:
    summary = parse_output(fixture("ok.txt"))
    assert (summary.total, summary.done, summary.succeeded) == (20, 20, 20)
    assert (summary.failed, summary.errored, summary.timeout) == (0, 0, 0)
    assert summary.status == {"2xx": 20, "3xx": 0, "4xx": 0, "5xx": 0}
    assert summary.data_bytes == 21220 == 20 * (FLOOR_ANSWER_BYTES + 5)
    assert summary.finished_s == pytest.approx(0.02245)
    assert summary.requests_per_s == pytest.approx(890.71)
    assert summary.request_ms == pytest.approx(
        {"min": 1.03, "max": 11.91, "mean": 4.13, "sd": 4.10}
    )
    assert summary.problems(20) == []
    assert summary.problems(21) == ["h2load: 20 of 21 requests done"]
    assert answers_short(summary, FLOOR_ANSWER_BYTES) == 0


def test_percentiles_come_from_the_log_file() -> None:
    entries = parse_log(fixture("ok.log.tsv"))
    assert len(entries) == 20
    assert {e.status for e in entries} == {200}
    figures = log_figures(entries)
    durations = sorted(e.duration_us for e in entries)
    assert figures["requests"] == 20
    assert figures["p50_ms"] == pytest.approx(durations[9] / 1000)  # nearest rank
    assert figures["p99_ms"] == pytest.approx(durations[-1] / 1000) == pytest.approx(11.909)
    span_us = max(e.start_us + e.duration_us for e in entries) - min(e.start_us for e in entries)
    assert figures["window_s"] == pytest.approx(span_us / 1e6)
    assert figures["requests_per_s"] == pytest.approx(20 / figures["window_s"])
    failed = parse_log("1\t-1\t5\n2\t200\t7\n")
    assert log_figures(failed)["requests"] == 1  # a failed stream (-1) has no latency


def test_grpc_errors_look_like_successes_to_h2load_but_not_to_the_data_check() -> None:
    summary = parse_output(fixture("grpc-error.txt"))  # UNIMPLEMENTED, 12 times
    assert summary.problems(12) == []  # HTTP 200 every time
    assert summary.data_bytes == 0
    assert answers_short(summary, FLOOR_ANSWER_BYTES) == 12


def test_a_run_with_no_server_reports_its_failures() -> None:
    summary = parse_output(fixture("refused.txt"))
    assert summary.problems(10)[0] == "h2load: 10 failed, 10 errored, 0 timed out"


def test_a_timed_run_parses_and_its_warm_up_artefacts_are_no_problem() -> None:
    summary = parse_output(fixture("duration.txt"))
    assert (summary.started, summary.done) == (2500, 2496)  # in flight at the end
    assert summary.finished_s == pytest.approx(1.0)
    assert summary.problems() == []


def test_h2load_durations_and_missing_lines() -> None:
    assert seconds("656us") == pytest.approx(656e-6)
    assert seconds("4.26ms") == pytest.approx(4.26e-3)
    assert seconds("3.00s") == pytest.approx(3.0)
    with pytest.raises(ValueError, match="duration"):
        seconds("1m")
    with pytest.raises(ValueError, match="no requests line"):
        parse_output("h2load: connection refused\n")


# -- targets and the CPU table ----------------------------------------------------------------


def _row(target: str, name: str, seq: str, load: str, **extra: Any) -> dict[str, Any]:
    return {
        "group": report.H2LOAD,
        "target": target,
        "name": name,
        "api": "v2",
        "seq": seq,
        "load": load,
        "pinned": True,
        "requests": 100,
        "errors": {},
        "rejected": 0,
        **extra,
    }


def _h2load_rows() -> list[dict[str, Any]]:
    def cpu(gateway: float, worker: float) -> dict[str, Any]:
        return {
            "server_cpu_us_per_request_by_process": {
                "supervisor": 1.0,
                "frontend-0": 2.0,
                "frontend-0-gateway": gateway,
                "worker": worker,
                "other": 0.0,
            }
        }

    one, many = "c=1 m=1", "c=1 m=64"
    limit = {
        "group": "headline",
        "target": "in-process",
        "name": "in-process",
        "seq": "16",
        "load": "-",
        "api": "-",
        "pinned": True,
        "sequences_per_s": 3000.0,
        "points": [{"batch_size": 1, "cpu_ms_per_sequence": 0.37}],
    }
    return [
        limit,
        _row("server", "server", "16", one, p50_ms=0.7, p99_ms=0.9, **cpu(300.0, 420.0)),
        _row(
            "server", "server", "16", many, requests_per_s=1200.0, p99_ms=60.0, **cpu(140.0, 500.0)
        ),
        _row(
            "server",
            "server",
            "128",
            many,
            requests_per_s=150.0,
            p99_ms=400.0,
            **cpu(500.0, 6000.0),
        ),
        _row(
            report.GRPC_FLOOR,
            report.GRPC_FLOOR,
            "16",
            one,
            p50_ms=0.3,
            server_cpu_us_per_request_by_process={"supervisor": 250.0, "other": 0.0},
        ),
        _row(report.GRPC_FLOOR, report.GRPC_FLOOR, "16", many, requests_per_s=2400.0),
        _row(
            report.GO_FLOOR, report.GO_FLOOR, "16", one, p50_ms=0.25, server_cpu_ms_per_request=0.2
        ),
        _row(report.GO_FLOOR, report.GO_FLOOR, "16", many, server_cpu_ms_per_request=0.1),
        _row("server", report.BESIDE_TRITON, "16", many, requests_per_s=1300.0, p99_ms=50.0),
        _row("triton", "triton b=32 delay=0us", "16", many, requests_per_s=1000.0, p99_ms=40.0),
    ]


def test_h2load_targets_as_stated() -> None:
    rows = _h2load_rows()
    found = {e["name"]: e for e in ratios.all_ratios(rows, "v2", {report.H2LOAD, "peers"})}
    p50 = found["One caller, seq 16, h2load: p50 (ms)"]
    assert (p50["value"], p50["target"], p50["met"]) == (0.7, "<= 0.75", True)
    assert found["One caller, seq 16, h2load: p50 - bare gRPC server's (ms)"][
        "value"
    ] == pytest.approx(0.4)
    assert found["One caller, seq 16, h2load: p50 - bare Go HTTP/2 server's (ms)"][
        "value"
    ] == pytest.approx(0.45)
    assert found["Gateway CPU per lone call over the bare Go HTTP/2 server's (us)"][
        "value"
    ] == pytest.approx(300.0 - 200.0)
    assert found["Gateway CPU per call over the bare Go HTTP/2 server's, seq 16, 64 streams (us)"][
        "value"
    ] == pytest.approx(140.0 - 100.0)
    not_run = "Gateway CPU per call over the bare Go HTTP/2 server's, seq 128, 64 streams (us)"
    assert found[not_run]["value"] is None  # no floor row at seq 128: not measured
    worker = found["Worker CPU per lone request over ONNX Runtime's (us)"]
    assert worker["value"] == pytest.approx(420.0 - 370.0)
    assert (worker["target"], worker["met"]) == ("<= 60", True)
    gateway16 = found["Gateway CPU per call, seq 16, 64 streams (us)"]
    assert (gateway16["value"], gateway16["met"]) == (140.0, True)
    gateway128 = found["Gateway CPU per call, seq 128, 64 streams (us)"]
    assert (gateway128["value"], gateway128["target"], gateway128["met"]) == (
        500.0,
        "<= 450",
        False,
    )
    assert found["h2load, 64 streams, seq 16: server / bare gRPC server (req/s)"][
        "value"
    ] == pytest.approx(0.5)
    # Against Triton: the rows measured beside it, not the earlier ones.
    over = found["h2load, 64 streams, seq 16: server / Triton (req/s)"]
    assert (over["value"], over["met"]) == (pytest.approx(1.3), True)
    p99 = found["h2load, 64 streams, seq 16: server p99 / Triton p99"]
    assert (p99["value"], p99["met"]) == (pytest.approx(1.25), False)
    missing = found["h2load, 64 streams, seq 128: server / Triton (req/s)"]
    assert (missing["value"], missing["met"]) == (None, None)  # not measured
    names = {e["name"] for e in h2load_report.section(rows, peers=False)}
    assert not any("Triton" in name for name in names)  # no peers, no Triton lines
    text = ratios.format_ratios(ratios.targets(h2load_report.section(rows, peers=True)))
    assert "MISSED" in text
    assert "issue" not in text.lower()


def test_a_failed_h2load_row_reads_not_measured() -> None:
    rows = [
        {**row, "failed": "3 of 100 answers carried no message"}
        if row["group"] == report.H2LOAD
        else row
        for row in _h2load_rows()
    ]
    for item in h2load_report.section(rows, peers=True):
        if item["name"] != "ONNX Runtime's run of it, in-process CPU (us)":
            assert item["value"] is None
            assert item["met"] is None
    assert h2load_report.cpu_table(rows) == ""
    lines = report.format_table(rows).splitlines()
    h2load_lines = [line for line in lines if line.startswith(report.H2LOAD)]
    assert len(h2load_lines) == len(rows) - 1
    assert all(line.split()[-3:-1] == ["FAIL", "FAIL"] for line in h2load_lines)


def test_cpu_per_call_by_process_table() -> None:
    table = h2load_report.cpu_table(_h2load_rows()).splitlines()
    assert table[0].split() == [
        "supervisor",
        "front",
        "ends",
        "gateways",
        "worker",
        "other",
        "total",
    ]
    assert len(table) == 1 + 4  # the rows with per-process figures
    server = next(line for line in table if line.lstrip().startswith("server seq 16 c=1 m=1"))
    assert server.split()[-6:] == ["1", "2", "300", "420", "0", "723"]
    floor = next(line for line in table if line.lstrip().startswith(report.GRPC_FLOOR))
    assert floor.split()[-6:] == ["250", "-", "-", "-", "0", "250"]


# -- the scenarios: where the rows come from, and a missing h2load ----------------------------


def _config(**overrides: Any) -> BenchConfig:
    values: dict[str, Any] = {
        "model_repository": Path("models"),
        "model": "mha",
        "model_path": Path("m.onnx"),
        "embed_dim": D,
        "num_heads": 2,
        "duration_s": 0.5,
        "warmup_s": 0.2,
        "inprocess_seconds": 0.1,
        "mixed_count": 8,
        "concurrency": 4,
        "api": "v2",
        "channels": 1,
        "max_outstanding": 256,
        "max_batch_size": 32,
        "max_seq_len": 512,
        "provider": "cpu",
        "server_flags": (),
        "pinning": Pinning(None, None),
    }
    return BenchConfig(**(values | overrides))


def test_without_h2load_the_rows_are_skipped_with_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(h2load, "find", lambda: None)
    runner = Runner(_config(), scratch=tmp_path)
    scenarios.h2load_rows(runner, SimpleNamespace(), target="server", name="server")
    assert runner.rows == []
    assert len(runner.notes) == 1
    assert "apt-get install nghttp2-client" in runner.notes[0]


def test_h2load_rows_are_one_caller_and_many_streams_at_both_lengths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(h2load, "find", lambda: "/usr/bin/h2load")
    runner = Runner(_config(concurrency=64), scratch=tmp_path)
    asked: list[tuple[str, str, str]] = []

    def row(service: object, **labels: Any) -> dict[str, Any]:
        asked.append((labels["target"], labels["seq"], labels["shape"].label))
        return {}

    monkeypatch.setattr(runner, "h2load_row", row)
    scenarios.h2load_rows(runner, SimpleNamespace(), target="server", name="server")
    assert asked == [
        ("server", "16", "c=1 m=1"),
        ("server", "16", "c=1 m=64"),
        ("server", "128", "c=1 m=1"),
        ("server", "128", "c=1 m=64"),
    ]
    assert "h2load" in scenarios.STANDARD


# -- real runs against a real server ----------------------------------------------------------


@pytest.fixture(scope="module")
def tool() -> str:
    found = h2load.find()
    if found is None:
        message = f"h2load not installed ({h2load.INSTALL_HINT})"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def echo_server(
    tool: str, grpc_gateway: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The real server (gateway on, then off) serving the zero-compute model, d=16."""
    repository = tmp_path_factory.mktemp("echo")
    write_repository(repository, "mha", D, 2)
    with ServerProcess(repository, "--intra-op-threads", "1") as server:
        yield server


def _service(server: ServerProcess) -> SimpleNamespace:
    """What Runner.h2load_row reads of a bench Service, from a test's ServerProcess."""
    return SimpleNamespace(
        target=server.target,
        pid=server.process.pid,
        children=child_pids(server),
        metrics_url=f"http://127.0.0.1:{server.metrics_port}/metrics",
    )


def test_a_real_h2load_row_against_the_real_server(
    echo_server: ServerProcess, grpc_gateway: str, tmp_path: Path
) -> None:
    runner = Runner(_config(), scratch=tmp_path)
    row = runner.h2load_row(
        _service(echo_server),
        group=report.H2LOAD,
        target="server",
        name="server",
        seq="16",
        shape=h2load.Shape(1, 4),
        pinning=Pinning(None, None),
    )
    assert not row.get("failed"), row["failed"]
    assert runner.rows == [row]
    assert (row["group"], row["load"], row["api"]) == (report.H2LOAD, "c=1 m=4", "v2")
    assert row["requests"] >= 20
    assert row["requests"] == row["h2load"]["summary"]["done"]
    assert row["sequences_per_s"] == row["requests_per_s"] > 0
    assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["p99.9_ms"]
    assert row["h2load"]["answer_bytes"] > D * 16 * 4  # the echoed tensor came back
    assert "te: trailers" in row["h2load"]["command"]
    each = row["server_cpu_us_per_request_by_process"]
    assert {"supervisor", "worker", "frontend-0", "other"} <= set(each)
    assert ("frontend-0-gateway" in each) == (grpc_gateway == "on")
    assert each["worker"] > 0
    assert row["client_cpu_us_per_request"] > 0
    assert row["server_metrics"]["batches"] > 0
    assert h2load_report.cpu_table([row]).count("\n") == 1  # a header and this row


def test_a_server_that_answers_errors_fails_the_row_loudly(
    echo_server: ServerProcess, tool: str, tmp_path: Path
) -> None:
    # The gRPC check: a model the server does not serve is NOT_FOUND before h2load runs.
    runner = Runner(_config(model="nope"), scratch=tmp_path)
    row = runner.h2load_row(
        _service(echo_server),
        group=report.H2LOAD,
        target="server",
        name="server",
        seq="16",
        shape=h2load.Shape(1, 2),
        pinning=Pinning(None, None),
    )
    assert "NOT_FOUND" in row["failed"]
    assert row["sequences_per_s"] is None
    assert any("FAILED" in note and "NOT_FOUND" in note for note in runner.notes)
    # h2load itself: the same errors are HTTP 200 to it, and the data check counts them.
    good = h2load.grpc_check(echo_server.target, h2load.request_message(16, D, "mha"))
    body = tmp_path / "bad.bin"
    body.write_bytes(h2load.frame(h2load.request_message(16, D, "nope")))
    argv = h2load.command(tool, echo_server.target, body, h2load.Shape(1, 2), requests=10)
    output, _ = h2load.run(argv, timeout_s=60)
    summary = parse_output(output)
    assert summary.problems(10) == []
    assert answers_short(summary, good) == 10


@pytest.fixture(scope="module")
def go_floor() -> Iterator[Service]:
    """The bare Go HTTP/2 server (bench/h2floor/), built as the benchmark builds it."""
    command = [str(built("h2floor")), "-port", "0"]
    with Service(report.GO_FLOOR, command, new_session=False) as service:
        service.wait_ready(30)
        yield service


def test_the_go_floor_answers_as_the_bare_grpc_server_does(go_floor: Service) -> None:
    """The two floors give the same answer to the benchmark's requests, byte for byte, so
    their rows carry the same work (the Go floor reads only what the benchmark sends); what
    it cannot read is a gRPC error, never a hang."""
    messages = [h2load.request_message(seq, D, "mha") for seq in (16, 128)]
    floor_command = [sys.executable, "-m", "bench.grpc_floor"]
    with Service(report.GRPC_FLOOR, floor_command, new_session=False) as grpc_floor:
        grpc_floor.wait_ready(30)
        for message in messages:
            answers = [_model_infer(server.target, message) for server in (grpc_floor, go_floor)]
            assert answers[0] == answers[1]
    message = messages[0]
    answers = [b"", _model_infer(go_floor.target, message)]
    answer = v2.ModelInferResponse.FromString(answers[1])
    assert (
        answer.raw_output_contents[0]
        == v2.ModelInferRequest.FromString(message).raw_input_contents[0]
    )
    with pytest.raises(grpc.RpcError) as refused:
        _model_infer(go_floor.target, b"\x0f")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(go_floor.target) as channel:
        unknown = channel.unary_unary("/inference.GRPCInferenceService/Nope")
        with pytest.raises(grpc.RpcError) as refused:
            unknown(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _model_infer(target: str, message: bytes) -> bytes:
    """A V2 ModelInfer call with message as its request; the answer's bytes."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=None,
        )
        answer: bytes = call(message, timeout=10)
        return answer


def test_a_real_h2load_row_against_the_go_floor(
    go_floor: Service, tool: str, tmp_path: Path
) -> None:
    runner = Runner(_config(), scratch=tmp_path)
    row = runner.h2load_row(
        go_floor,
        group=report.H2LOAD,
        target=report.GO_FLOOR,
        name=report.GO_FLOOR,
        seq="16",
        shape=h2load.Shape(1, 4),
        pinning=Pinning(None, None),
    )
    assert not row.get("failed"), row["failed"]
    assert row["requests"] >= 20
    assert row["h2load"]["answer_bytes"] > D * 16 * 4  # the tensor came back
    assert row["server_cpu_ms_per_request"] > 0
    assert "go http2 floor seq 16 c=1 m=4" in h2load_report.cpu_table([row])


# -- getting h2load: make bench's installer -----------------------------------------------------


def _installer(tmp_path: Path, uid: int, apt_get: str) -> tuple[subprocess.CompletedProcess, Path]:
    """bench/install_h2load.sh with a PATH of fakes only: no h2load, `id -u` saying uid, and
    an apt-get that logs its arguments and then runs apt_get (shell)."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    calls = tmp_path / "apt-get.log"
    for name, body in (("id", f"echo {uid}"), ("apt-get", f'echo "$@" >> {calls}\n{apt_get}')):
        (fakes / name).write_text(f"#!/bin/sh\n{body}\n")
        (fakes / name).chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", str(REPO_ROOT / "bench" / "install_h2load.sh")],
        env={"PATH": str(fakes)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, calls


def test_the_installer_uses_apt_as_root(tmp_path: Path) -> None:
    done, calls = _installer(tmp_path, 0, "exit 0")
    assert done.returncode == 0
    assert "install -y -qq --no-install-recommends nghttp2-client" in calls.read_text()
    assert "skipped" not in done.stderr


def test_the_installer_says_how_and_never_fails_the_benchmark(tmp_path: Path) -> None:
    done, calls = _installer(tmp_path, 1000, "exit 1")
    assert done.returncode == 0
    assert not calls.exists()  # not root: apt is not tried
    assert "apt-get install nghttp2-client" in done.stderr
    assert "skipped" in done.stderr
    (tmp_path / "bin").rename(tmp_path / "old")
    done, calls = _installer(tmp_path, 0, "exit 100")  # root, but apt fails (then updates)
    assert done.returncode == 0
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["install", "update"]
    assert "skipped" in done.stderr


def test_triton_and_the_server_take_turns_beside_each_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from bench.peers import triton

    monkeypatch.setattr(h2load, "find", lambda: "/usr/bin/h2load")
    runner = Runner(_config(concurrency=64), scratch=tmp_path)
    ours, peer = SimpleNamespace(who="ours"), SimpleNamespace(who="triton")
    asked: list[tuple[object, str, str, str, str]] = []

    def row(service: object, **labels: Any) -> dict[str, Any]:
        asked.append(
            (service, labels["target"], labels["name"], labels["seq"], labels["shape"].label)
        )
        return {}

    monkeypatch.setattr(runner, "h2load_row", row)
    triton.h2load_beside(runner, ours, peer, "triton b=32 delay=0us")  # type: ignore[arg-type]
    assert len(asked) == 2 * 2 * len(report.SEQS)
    pairs = [asked[i : i + 2] for i in range(0, len(asked), 2)]
    for first, second in pairs:  # the same length and shape on both, one after the other
        assert first[3:] == second[3:]
        assert {first[0].who, second[0].who} == {"ours", "triton"}  # type: ignore[attr-defined]
    assert [pair[0][1] for pair in pairs] == ["server", "triton", "server", "triton"]
    assert {(a[1], a[2]) for a in asked} == {
        ("server", report.BESIDE_TRITON),
        ("triton", "triton b=32 delay=0us"),
    }


def test_a_feature_s_throughput_is_kept_against_the_default_of_its_rounds() -> None:
    """Each feature's rows and the default server's beside them come in rounds: the ratio is
    of their medians, not of the feature against the default measured minutes earlier."""
    many = "c=1 m=64"
    rows = _h2load_rows()  # the default's own row: 1200 req/s at seq 16
    for rate_default, rate_sampled, rate_key in (
        (1600.0, 1500.0, 1550.0),
        (1400.0, 1340.0, 1420.0),
    ):
        rows += [
            _row("server", report.BESIDE_FEATURES, "16", many, requests_per_s=rate_default),
            _row("server", report.TRACING_SAMPLED, "16", many, requests_per_s=rate_sampled),
            _row("server", report.RESTRICTED, "16", many, requests_per_s=rate_key),
        ]
    found = {e["name"]: e for e in h2load_report.section(rows, peers=False)}
    sampled = found["h2load, 64 streams, seq 16: tracing on, 1% sampled / default (req/s)"]
    assert sampled["value"] == pytest.approx((1500 + 1340) / (1600 + 1400))
    assert sampled["met"] is True
    key = found["h2load, 64 streams, seq 16: inference key checked / default (req/s)"]
    assert key["value"] == pytest.approx((1550 + 1420) / (1600 + 1400))
    assert found["h2load, 64 streams, seq 16: tracing on / default (req/s)"]["value"] is None
