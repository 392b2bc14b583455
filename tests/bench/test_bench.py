"""The benchmark suite's pure pieces, and short end-to-end runs against the real server serving
the echo model. Nothing here asserts on speed."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from bench import (
    cputime,
    echo_model,
    h2load,
    inprocess,
    ratios,
    report,
    scenarios,
    scrape,
    worker_alone,
)
from bench.launcher import REPO_ROOT, Pinning, choose_pinning, cpu_count
from bench.payloads import (
    attend_stream_reply,
    attend_timing,
    build_payloads,
    fields,
    v2_stream_reply,
    with_id,
)
from bench.peers import triton
from bench.runner import (
    BenchConfig,
    Runner,
    describe,
    failed_inprocess,
    failed_result,
    overridden_flags,
)
from bench.stats import (
    Lengths,
    bucket_counts,
    latency_summary_ms,
    percentile,
    poisson_arrivals,
    stack_ceiling,
)
from export.pipeline import ExportRequest, run_export
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc
from tests.harness.server_process import ServerProcess, child_pids, in_mode

# -- statistics --------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 99.9) == 100
    assert percentile(values, 100) == 100
    assert percentile([7.0], 99.9) == 7.0
    assert math.isnan(percentile([], 50))


def test_latency_summary_in_milliseconds() -> None:
    summary = latency_summary_ms([0.001, 0.002, 0.003, 0.004])
    assert summary["p50_ms"] == pytest.approx(2.0)
    assert summary["p99.9_ms"] == pytest.approx(4.0)
    assert summary["mean_ms"] == pytest.approx(2.5)
    assert set(summary) == {"p50_ms", "p90_ms", "p99_ms", "p99.9_ms", "mean_ms"}


@pytest.mark.parametrize(
    ("text", "low", "high"), [("128", 128, 128), ("uniform:16:256", 16, 256), (" 8 ", 8, 8)]
)
def test_lengths_parse(text: str, low: int, high: int) -> None:
    lengths = Lengths.parse(text)
    assert (lengths.low, lengths.high) == (low, high)
    assert Lengths.parse(str(lengths)) == lengths
    drawn = lengths.draw(np.random.default_rng(0), 1000)
    assert drawn.min() >= low
    assert drawn.max() <= high


@pytest.mark.parametrize("text", ["", "x", "0", "uniform:16", "uniform:256:16", "normal:1:2"])
def test_lengths_reject_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="sequence length"):
        Lengths.parse(text)


def test_poisson_arrivals_have_the_rate_and_stay_in_the_window() -> None:
    times = poisson_arrivals(1000.0, 5.0, np.random.default_rng(1))
    assert np.all(np.diff(times) > 0)
    assert times[0] >= 0
    assert times[-1] < 5.0
    assert len(times) == pytest.approx(5000, rel=0.05)  # sd is sqrt(5000) ~ 1.4 %
    gaps = np.diff(times)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)  # exponential: sd = mean
    assert len(poisson_arrivals(0.0, 5.0, np.random.default_rng(1))) == 0


def test_poisson_arrivals_top_up_when_the_first_draw_falls_short() -> None:
    times = poisson_arrivals(1.0, 200.0, np.random.default_rng(3))
    assert times[-1] < 200.0
    assert len(times) > 100


def test_stack_ceiling_adds_per_request_costs() -> None:
    # 1 ms of protocol + 1 ms of compute per request on one core = 500 requests/s.
    assert stack_ceiling(1000.0, 1000.0) == pytest.approx(500.0)
    assert stack_ceiling(3658.0, 2884.0) == pytest.approx(1612.6, abs=0.1)
    assert stack_ceiling(0.0, 100.0) == 0.0


# -- CPU time ---------------------------------------------------------------------------------


def test_parse_stat_counts_fields_after_the_command_name() -> None:
    line = "42 (a (weird) name) S 7 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 5 0 0"
    assert cputime.parse_stat(line, 100.0) == (7, 3.0)


@pytest.mark.skipif(not cputime.available(), reason="no /proc")
def test_cpu_seconds_of_this_process_grow() -> None:
    before = cputime.process_cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cputime.process_cpu_s(os.getpid()) > before
    assert cputime.tree_cpu_s(os.getpid()) >= cputime.process_cpu_s(os.getpid()) - 0.02


def _fake_proc(root: Path, processes: dict[int, tuple[int, float]]) -> Path:
    """A /proc with one stat file per pid: {pid: (parent, CPU seconds)}."""
    ticks = os.sysconf("SC_CLK_TCK")
    for pid, (parent, cpu_s) in processes.items():
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        utime = round(cpu_s * ticks * 0.75)
        stime = round(cpu_s * ticks) - utime
        zeros = " ".join(["0"] * 9)
        (root / str(pid) / "stat").write_text(
            f"{pid} (python3) S {parent} {zeros} {utime} {stime} 0 0 20 0 1 0 5 0 0\n"
        )
    (root / "self").mkdir(exist_ok=True)  # not a pid: skipped
    return root


def test_cpu_per_process_from_fake_proc_snapshots(tmp_path: Path) -> None:
    # supervisor 10 -> worker 11, frontend-0 12, resource tracker 13; 99 is someone else's.
    before = {10: (1, 1.0), 11: (10, 5.0), 12: (10, 2.0), 13: (10, 0.1), 99: (1, 50.0)}
    after = {
        10: (1, 1.2),
        11: (10, 8.0),
        12: (10, 3.5),
        13: (10, 0.1),
        99: (1, 90.0),
        14: (12, 0.3),
    }  # 14: born in the window, under the front end
    first = cputime.family_cpu_s(10, _fake_proc(tmp_path / "a", before))
    second = cputime.family_cpu_s(10, _fake_proc(tmp_path / "b", after))
    assert set(first) == {10, 11, 12, 13}
    assert set(second) == {10, 11, 12, 13, 14}
    assert second[11] == pytest.approx(8.0)
    roles = {"worker": 11, "frontend-0": 12}
    each = cputime.by_process(first, second, roles, 10)
    assert each == pytest.approx(
        {"worker": 3.0, "frontend-0": 1.5, "supervisor": 0.2, "other": 0.3}
    )
    # A front end restarted inside the window (its old pid gone) counts from zero.
    gone = {pid: cpu for pid, cpu in second.items() if pid != 12} | {15: 0.4}
    each = cputime.by_process(first, gone, {"worker": 11, "frontend-0": 15}, 10)
    assert each["frontend-0"] == pytest.approx(0.4)


def test_cpu_per_thread_names_the_main_thread(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")

    def snapshot(folder: str, threads: dict[int, tuple[str, float]]) -> Path:
        for tid, (name, cpu_s) in threads.items():
            task = tmp_path / folder / "12" / "task" / str(tid)
            task.mkdir(parents=True)
            zeros = " ".join(["0"] * 9)
            task.joinpath("stat").write_text(
                f"{tid} ({name}) S 10 {zeros} {round(cpu_s * ticks)} 0 0 0 20 0 1 0 5 0 0\n"
            )
        return tmp_path / folder

    before = cputime.thread_cpu_s(
        12, snapshot("a", {12: ("python3", 1.0), 20: ("grpc_global_tim", 0.5)})
    )
    after = cputime.thread_cpu_s(
        12,
        snapshot(
            "b",
            {
                12: ("python3", 1.5),
                20: ("grpc_global_tim", 0.7),
                21: ("onnxruntime", 2.0),
                22: ("onnxruntime", 1.0),
            },
        ),
    )
    assert after[21] == ("onnxruntime", pytest.approx(2.0))
    used = cputime.by_thread(before, after, 12)
    assert used == pytest.approx({"main": 0.5, "grpc_global_tim": 0.2, "onnxruntime": 3.0})
    assert cputime.thread_cpu_s(99, tmp_path / "b") == {}  # gone: nothing, no error


def test_process_cpu_columns_sum_the_front_ends() -> None:
    row = {
        **_rows()[2],
        "client_cpu_us_per_request": 120.0,
        "server_cpu_us_per_request_by_process": {
            "worker": 300.0,
            "frontend-0": 200.0,
            "frontend-1": 150.0,
            "supervisor": 1.0,
        },
    }
    assert report.process_cpu_us(row) == (350.0, 300.0)
    assert report.process_cpu_us(_rows()[3]) == (None, None)  # a peer: no roles
    header, line = report.format_table([row]).splitlines()
    assert "fe us/rq  wk us/rq  lg us/rq" in header
    assert line.split()[-6:-3] == ["350", "300", "120"]  # then err, rej, client


# -- Prometheus -------------------------------------------------------------------------------

METRICS = """\
# TYPE attention_batch_size_sequences histogram
attention_batch_size_sequences_bucket{{model="mha",le="1.0"}} {b1}
attention_batch_size_sequences_bucket{{model="mha",le="8.0"}} {b8}
attention_batch_size_sequences_bucket{{model="mha",le="+Inf"}} {b8}
attention_batch_size_sequences_count{{model="mha"}} {b8}
attention_batch_size_sequences_sum{{model="mha"}} {size_sum}
# TYPE attention_queue_duration_seconds histogram
attention_queue_duration_seconds_count{{model="mha"}} {queued}
attention_queue_duration_seconds_sum{{model="mha"}} {queue_sum}
"""


def test_scrape_difference_gives_batches_and_means() -> None:
    before = scrape.parse(METRICS.format(b1=1, b8=2, size_sum=9, queued=9, queue_sum=0.009))
    after = scrape.parse(METRICS.format(b1=3, b8=6, size_sum=25, queued=25, queue_sum=0.041))
    summary = scrape.summarize(before, after)
    assert summary["batches"] == 4
    assert summary["mean_batch_size"] == pytest.approx(4.0)  # 16 sequences in 4 batches
    assert summary["mean_queue_ms"] == pytest.approx(2.0)  # 32 ms over 16 requests
    assert summary["batch_size_buckets"] == {"1.0": 2, "8.0": 2, "+Inf": 0}
    assert math.isnan(summary["mean_padding_ratio"])  # not in this text


def test_bucket_counts_undo_cumulation() -> None:
    assert bucket_counts({"+Inf": 10, "2.0": 7, "1.0": 3}) == {"1.0": 3, "2.0": 4, "+Inf": 3}


# -- payloads and the wire walker -------------------------------------------------------------


def test_prebuilt_attend_request_takes_an_id_without_reencoding() -> None:
    payloads = build_payloads(
        "attention", Lengths.parse("4"), embed_dim=8, sequences=1, weights_fraction=0.5, model="mha"
    )
    assert set(payloads) == {(4, False), (4, True)}
    request = pb.AttendRequest.FromString(with_id(payloads[4, True].body, "attention", b"r-7"))
    assert request.request_id == "r-7"
    assert list(request.embeddings.shape) == [4, 8]
    assert request.return_attention_weights


def test_prebuilt_v2_request_lists_outputs_only_for_weights() -> None:
    payloads = build_payloads(
        "v2_stream",
        Lengths.parse("uniform:2:3"),
        embed_dim=4,
        sequences=2,
        weights_fraction=1.0,
        model="m",
    )
    assert set(payloads) == {(2, True), (3, True)}
    request = v2.ModelInferRequest.FromString(with_id(payloads[3, True].body, "v2", b"abc"))
    assert (request.id, request.model_name, list(request.inputs[0].shape)) == (
        "abc",
        "m",
        [2, 3, 4],
    )
    assert [o.name for o in request.outputs] == ["output", "attention_weights"]
    assert len(request.raw_input_contents[0]) == 2 * 3 * 4 * 4
    plain = build_payloads(
        "v2", Lengths.parse("3"), embed_dim=4, sequences=1, weights_fraction=0.0, model="m"
    )
    assert not v2.ModelInferRequest.FromString(plain[3, False].body).outputs


def test_prebuilt_rest_request_is_a_json_header_then_the_tensor() -> None:
    payloads = build_payloads(
        "v2_rest", Lengths.parse("3"), embed_dim=4, sequences=2, weights_fraction=1.0, model="m"
    )
    payload = payloads[3, True]
    header = json.loads(payload.body[: payload.header_bytes])
    (tensor,) = header["inputs"]
    assert (tensor["name"], tensor["shape"], tensor["datatype"]) == (
        "embeddings",
        [2, 3, 4],
        "FP32",
    )
    assert tensor["parameters"]["binary_data_size"] == len(payload.body) - payload.header_bytes
    assert [o["name"] for o in header["outputs"]] == ["output", "attention_weights"]


def test_wire_walker_reads_timing_without_the_tensor() -> None:
    response = pb.AttendResponse(
        output=pb.Tensor(shape=[300, 512], data=bytes(300 * 512 * 4)),
        request_id="x",
        timing=pb.ServerTiming(queue_us=5, compute_us=300_000, batch_size=7),
    ).SerializeToString()
    timing = attend_timing(response)
    assert timing is not None
    assert (timing.queue_us, timing.compute_us, timing.batch_size) == (5, 300_000, 7)
    assert attend_timing(pb.AttendResponse().SerializeToString()) is None
    assert fields(b"\x08\x96\x01") == {1: 150}  # the protobuf docs' varint example


def test_stream_replies_carry_id_code_and_timing() -> None:
    error = pb.AttendStreamResponse(request_id="a", error=pb.StreamError(code=3, message="bad"))
    reply = attend_stream_reply(error.SerializeToString())
    assert (reply.request_id, reply.code, reply.timing) == ("a", "INVALID_ARGUMENT", None)
    ok = pb.AttendStreamResponse(
        request_id="b", response=pb.AttendResponse(timing=pb.ServerTiming(batch_size=3))
    )
    reply = attend_stream_reply(ok.SerializeToString())
    assert (reply.request_id, reply.code, reply.timing.batch_size) == ("b", "OK", 3)  # type: ignore[union-attr]
    v2_ok = v2.ModelStreamInferResponse(infer_response=v2.ModelInferResponse(id="c"))
    assert v2_stream_reply(v2_ok.SerializeToString()).code == "OK"
    v2_error = v2.ModelStreamInferResponse(error_message="no", infer_response={"id": "d"})
    reply = v2_stream_reply(v2_error.SerializeToString())
    assert (reply.request_id, reply.code) == ("d", "STREAM_ERROR")


# -- in-process planning ----------------------------------------------------------------------


def test_sorted_groups_pad_less_than_first_come_groups() -> None:
    lengths = [100, 10, 90, 20, 80, 30, 70, 40]
    by_length = inprocess.sorted_groups(lengths, 2)
    first_come = inprocess.arrival_groups(len(lengths), 2)
    assert sorted(i for group in by_length for i in group) == list(range(8))  # sizes add up
    assert first_come == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert inprocess.padding_ratio(lengths, by_length) < inprocess.padding_ratio(
        lengths, first_come
    )
    assert inprocess.padding_ratio(lengths, [[i] for i in range(8)]) == 0.0
    assert inprocess.padding_ratio([1, 3], [[0, 1]]) == pytest.approx(2 / 6)


def test_padded_feeds_mask_the_padding() -> None:
    feeds = inprocess.padded_feeds([np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)], 3)
    assert feeds["embeddings"].shape == (2, 4, 3)
    assert feeds["key_padding_mask"].tolist() == [[False, False, True, True], [False] * 4]
    assert feeds["embeddings"][0, 2:].sum() == 0


def test_powers_of_two_end_at_the_limit() -> None:
    assert inprocess.powers_of_two(32) == [1, 2, 4, 8, 16, 32]
    assert inprocess.powers_of_two(24) == [1, 2, 4, 8, 16, 24]
    assert inprocess.powers_of_two(1) == [1]


# -- pinning ----------------------------------------------------------------------------------


def test_cpu_count_reads_taskset_lists() -> None:
    assert cpu_count("1") == 1
    assert cpu_count("0,2-3") == 3


def test_no_taskset_means_unpinned_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.launcher.shutil.which", lambda _: None)
    pinning = choose_pinning("1", "0")
    assert not pinning.pinned
    assert "taskset" in pinning.note
    assert pinning.prefix(pinning.server_cpus) == []
    assert pinning.server_threads == 0
    assert Pinning("2-3", "0").server_threads == 2


# -- table and ratios -------------------------------------------------------------------------


def _rows() -> list[report.Row]:
    def load(target: str, name: str, api: str, seq: str, value: float, **extra: object) -> dict:
        return {
            "group": "headline",
            "target": target,
            "name": name,
            "api": api,
            "seq": seq,
            "load": "c=64",
            "pinned": True,
            "sequences_per_s": value,
            "requests": 10,
            "p50_ms": 1.0,
            "p99_ms": 2.0,
            "p99.9_ms": 3.0,
            "errors": {},
            "rejected": 0,
            "client_cpu_utilization": 0.5,
            "server_cpu_ms_per_request": 0.25,
            **extra,
        }

    limit = {
        "group": "headline",
        "target": "in-process",
        "name": "in-process",
        "api": "-",
        "seq": "16",
        "load": "-",
        "pinned": True,
        "sequences_per_s": 3000.0,
        "threads": 1,
        "best": {"batch_size": 8, "sequences_per_s": 3000.0, "ms_per_batch": 2.67},
        "points": [{"batch_size": 1, "sequences_per_s": 2000.0, "ms_per_batch": 0.5}],
    }
    return [
        limit,
        load("echo", "echo", "v2", "16", 4000.0),
        load("server", "server", "v2", "16", 1500.0, server_cpu_ms_per_sequence=0.6),
        {**load("mlserver", "mlserver b=8", "v2", "16", 500.0, p99_ms=8.0), "group": "peers"},
    ]


def test_ceiling_and_ratios_come_from_rows_of_the_run() -> None:
    rows = _rows()
    ceilings = report.ceiling_rows(rows)
    assert len(ceilings) == 1
    assert ceilings[0]["sequences_per_s"] == pytest.approx(stack_ceiling(4000.0, 3000.0))
    found = {r["name"]: r for r in ratios.all_ratios(rows + ceilings, "v2", {"headline", "peers"})}
    server_over_ceiling = found["seq 16 v2: server / stack ceiling"]
    assert server_over_ceiling["value"] == pytest.approx(1500.0 / stack_ceiling(4000.0, 3000.0))
    assert server_over_ceiling["met"] is False
    assert found["seq 16 v2: echo floor CPU us per request"]["value"] == pytest.approx(250.0)
    assert found["seq 16: server / mlserver b=8 (seq/s)"]["value"] == pytest.approx(3.0)
    assert found["seq 16: server p99 / mlserver p99"]["value"] == pytest.approx(0.25)
    assert found["seq 128 v2: server / stack ceiling"]["value"] is None  # not measured


def test_the_bare_grpc_floor_sets_the_echo_front_ends_cost_against_the_library() -> None:
    rows = _rows()
    rows[1]["server_cpu_us_per_request_by_process"] = {"frontend-0": 200.0, "worker": 50.0}
    rows.append(
        {
            **rows[1],
            "target": report.GRPC_FLOOR,
            "name": report.GRPC_FLOOR,
            "server_cpu_ms_per_request": 0.08,
            "sequences_per_s": 6000.0,
        }
    )
    found = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"headline"})}
    assert found["seq 16: echo front end / bare gRPC server, CPU per request"]["value"] == (
        pytest.approx(2.5)
    )
    assert found["seq 16: bare gRPC server (seq/s)"]["value"] == pytest.approx(6000.0)
    assert found["seq 128: echo front end / bare gRPC server, CPU per request"]["value"] is None


def test_one_caller_sets_the_server_beside_the_grpc_and_echo_floors() -> None:
    rows = _rows()
    one = {"load": "c=1"}
    rows += [
        {**rows[2], **one, "p50_ms": 3.0},
        {**rows[1], **one, "name": f"echo, {report.ONE_CALLER}", "p50_ms": 1.75},
        {
            **rows[1],
            **one,
            "target": report.GRPC_FLOOR,
            "p50_ms": 1.25,
            "name": f"{report.GRPC_FLOOR}, {report.ONE_CALLER}",
        },
    ]
    assert len(report.ceiling_rows(rows)) == 1  # a one-caller echo row is a latency
    found = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"headline"})}
    assert found[ratios.C1_LATENCY]["value"] == pytest.approx(2.5)  # the b=1 call is 0.5 ms
    assert found["seq 16 c=1: bare gRPC server p50 (ms)"]["value"] == pytest.approx(1.25)
    assert found["seq 16 c=1: echo floor p50 (ms)"]["value"] == pytest.approx(1.75)
    assert found["seq 16 c=1: server p50 (ms)"]["value"] == pytest.approx(3.0)
    assert found["seq 16 c=1: in-process call (ms)"]["value"] == pytest.approx(0.5)
    # The c=64 figures still come from the c=64 echo row.
    assert found["seq 16 v2: echo floor CPU us per request"]["value"] == pytest.approx(250.0)


def test_shared_memory_ratios_compare_the_same_server_and_triton() -> None:
    rows = _rows()

    def shm(target: str, name: str, api: str, value: float, cpu_ms: float) -> dict:
        return {
            **rows[1],
            "group": "shm",
            "target": target,
            "name": name,
            "api": api,
            "sequences_per_s": value,
            "server_cpu_ms_per_request": cpu_ms,
        }

    rows += [
        shm("server", "client shm on", "v2", 1800.0, 0.6),
        shm("server", "client shm on", "v2_shm", 2850.0, 0.4),
        shm("triton", "triton b=32 delay=0us", "v2_shm", 1000.0, 1.0),
        shm("triton", "triton b=32 delay=1000us", "v2_shm", 1425.0, 0.7),
    ]
    found = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"shm"})}
    assert found["seq 16 shm: server / in-process"]["value"] == pytest.approx(0.95)
    assert found["seq 16 shm: server / in-process"]["met"] is True
    assert found["seq 16: shm / message (seq/s)"]["value"] == pytest.approx(2850 / 1800)
    assert found["seq 16 shm: server CPU us per request"]["value"] == pytest.approx(400.0)
    assert found["seq 16 message: server CPU us per request"]["value"] == pytest.approx(600.0)
    assert found["seq 16 triton shm: server CPU us per request"]["value"] == pytest.approx(700.0)
    assert found["seq 16 shm: server / triton b=32 delay=1000us"]["value"] == pytest.approx(2.0)
    assert found["seq 128 shm: server / in-process"]["value"] is None  # not measured


def test_table_has_a_line_per_row_and_dashes_for_gaps() -> None:
    rows = _rows()
    table = report.format_table(rows + report.ceiling_rows(rows))
    lines = table.splitlines()
    assert len(lines) == 1 + len(rows) + 1
    assert lines[0].split()[:3] == ["group", "target", "config"]
    assert "in-process b=8" in lines[1]
    assert "3000.0" in lines[1]
    assert "stack ceiling" in lines[-1]
    assert " - " in lines[-1]
    assert len({len(line.rstrip()) <= len(lines[0]) for line in lines}) == 1
    text = ratios.format_ratios(
        ratios.all_ratios(rows + report.ceiling_rows(rows), "v2", {"headline"})
    )
    assert "MISSED" in text
    assert "not measured" in text


# -- reviewed defects: failed rows, pinning mode, flags, dtypes, rejections --------------------


def _config(**overrides: Any) -> BenchConfig:
    values: dict[str, Any] = {
        "model_repository": Path("models"),
        "model": "mha",
        "model_path": Path("m.onnx"),
        "embed_dim": 16,
        "num_heads": 2,
        "duration_s": 1.0,
        "warmup_s": 0.5,
        "inprocess_seconds": 0.1,
        "mixed_count": 8,
        "concurrency": 64,
        "api": "v2",
        "channels": 1,
        "max_outstanding": 256,
        "max_batch_size": 32,
        "max_seq_len": 512,
        "provider": "cpu",
        "server_flags": (),
        "pinning": Pinning("1", "0"),
    }
    return BenchConfig(**(values | overrides))


class FakeRunner(Runner):
    """The scenarios' view of a Runner, with no process started: servers and loads are
    recorded, and every load run fails (the placeholder the real Runner keeps)."""

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config, scratch=Path("unused"))
        self.servers: list[tuple[str, list[str]]] = []
        self.channels: list[int] = []

    @contextmanager
    def server(
        self, name: str, flags: Sequence[str], pinning: Pinning, env: Any = None
    ) -> Iterator[Any]:
        self.servers.append((name, list(flags)))
        yield None

    @contextmanager
    def echo(self, pinning: Pinning, flags: Sequence[str] = ()) -> Iterator[Any]:
        self.servers.append(("echo", list(flags)))
        yield None

    def load(self, service: Any, **labels: Any) -> dict[str, Any]:
        pinning = labels.pop("pinning")
        concurrency = labels.get("concurrency") or self.config.concurrency
        load = f"rate={labels['rate']:.0f}" if labels.get("rate") else f"c={concurrency}"
        self.channels.append(labels.get("channels", 0))
        for key in ("concurrency", "weights", "model", "embed_dim", "rate", "channels"):
            labels.pop(key, None)
        return self._keep(failed_result("server died"), **labels, load=load, pinned=pinning.pinned)

    def h2load_row(self, service: Any, **labels: Any) -> dict[str, Any]:
        pinning, shape = labels.pop("pinning"), labels.pop("shape")
        return self._keep(
            failed_result("server died"),
            **labels,
            api="v2",
            load=shape.label,
            pinned=pinning.pinned,
        )

    def inprocess(self, **labels: Any) -> dict[str, Any]:
        pinning = labels.pop("pinning")
        weights = labels.pop("weights", False)
        return self._keep(
            failed_inprocess("crashed", pinning.server_threads),
            **labels,
            target="in-process",
            name="in-process" + (" +weights" if weights else ""),
            api="-",
            load="-",
            pinned=pinning.pinned,
        )


def test_failed_rows_go_through_scenarios_ratios_and_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scenarios, "server_has_flag", lambda flag: True)
    monkeypatch.setattr(h2load, "find", lambda: "h2load")  # its rows fail like the rest
    runner = FakeRunner(_config())
    groups = set(scenarios.STANDARD) | {"peers"}
    scenarios.limits(runner, groups)
    scenarios.echo(runner, groups)
    scenarios.default_server(runner, groups)  # the capacity run failed: no crash
    scenarios.tracing_on(runner, groups)
    scenarios.client_shared_memory(runner, groups)
    scenarios.other_servers(runner, groups)
    assert not any(row["group"] == "open" for row in runner.rows)  # no capacity, no open loop
    assert sum(row["group"] == report.H2LOAD for row in runner.rows) == 2 * len(report.SEQS)
    assert all(row["failed"] for row in runner.rows)
    placeholder = failed_result("x")
    for key in (
        "requests_per_s",
        "sequences_per_s",
        "p50_ms",
        "p99_ms",
        "p99.9_ms",
        "server_cpu_ms_per_request",
        "server_cpu_ms_per_sequence",
    ):
        assert key in placeholder
        assert placeholder[key] is None
    rows = runner.rows + report.ceiling_rows(runner.rows)
    for pinned in (True, False):
        found = ratios.all_ratios(rows, "v2", groups, pinned=pinned)
        assert found
        assert all(item["value"] is None and item["met"] is None for item in found)
        assert "MISSED" not in ratios.format_ratios(found)
    for section in (ratios.headline, ratios.batching, ratios.weights, ratios.peers):
        assert all(item["value"] is None for item in section(rows, "v2"))
    for simple in (ratios.mixed, ratios.unpinned, ratios.open_loop, ratios.shared_memory):
        assert all(item["value"] is None for item in simple(rows))
    table = report.format_table(rows)
    assert table.count("FAIL") >= len(rows) - len(report.ceiling_rows(runner.rows))


def test_unpinned_runs_one_and_two_front_ends_over_several_connections() -> None:
    runner = FakeRunner(_config())
    scenarios.other_servers(runner, {"unpinned"})
    assert runner.servers == [
        ("echo", ["--frontends", "1"]),
        ("server --frontends 1", ["--frontends", "1"]),
        ("echo", ["--frontends", "2"]),
        ("server --frontends 2", ["--frontends", "2"]),
    ]
    assert set(runner.channels) == {scenarios.UNPINNED_CHANNELS}
    names = [row["name"] for row in runner.rows if row["target"] != "in-process"]
    assert names.count("server --frontends 2") == len(report.SEQS)
    assert names.count("echo --frontends 1") == len(report.SEQS)


def test_unpinned_with_h2load_measures_each_server_again_over_as_many_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h2load, "find", lambda: "h2load")
    runner = FakeRunner(_config())
    scenarios.other_servers(runner, {"unpinned", report.H2LOAD})
    # Each server is started once; its h2load rows follow its load generator rows.
    assert [name for name, _ in runner.servers] == [
        "echo",
        "server --frontends 1",
        "echo",
        "server --frontends 2",
    ]
    h2load_rows = [row for row in runner.rows if report.by_h2load(row)]
    assert {row["load"] for row in h2load_rows} == {"c=8 m=8"}  # 64 callers over 8
    assert sorted((row["target"], row["name"], row["seq"]) for row in h2load_rows) == sorted(
        (what, report.unpinned_h2load_name(n, what), seq)
        for n in report.FRONTENDS
        for what in ("echo", "server")
        for seq in report.SEQS
    )
    assert all(row["group"] == "unpinned" and not row["pinned"] for row in h2load_rows)
    # The Python load generator's rows are still the ones the older ratios take.
    names = [row["name"] for row in runner.rows]
    assert names.count("server --frontends 1") == len(report.SEQS)
    assert not runner.notes  # 64 spread evenly: nothing to say


def test_unpinned_without_the_h2load_group_or_binary_has_no_h2load_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h2load, "find", lambda: "h2load")
    runner = FakeRunner(_config())
    scenarios.other_servers(runner, {"unpinned"})
    assert not any(report.by_h2load(row) for row in runner.rows)
    monkeypatch.setattr(h2load, "find", lambda: None)
    runner = FakeRunner(_config())
    scenarios.other_servers(runner, {"unpinned", report.H2LOAD})
    assert not any(report.by_h2load(row) for row in runner.rows)


@pytest.mark.parametrize(
    ("concurrency", "connections", "label", "in_flight"),
    [(64, 8, "c=8 m=8", 64), (4, 8, "c=4 m=1", 4), (1, 8, "c=1 m=1", 1), (100, 8, "c=8 m=13", 104)],
)
def test_h2load_spreads_the_callers_over_the_connections(
    concurrency: int, connections: int, label: str, in_flight: int
) -> None:
    shape = scenarios.spread(concurrency, connections)
    assert (shape.label, shape.in_flight) == (label, in_flight)


def test_an_uneven_spread_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h2load, "find", lambda: "h2load")
    runner = FakeRunner(_config(concurrency=100))
    scenarios.other_servers(runner, {"unpinned", report.H2LOAD})
    assert any("104 calls in flight" in note and "keeps 100" in note for note in runner.notes)


def test_unpinned_ratios_read_the_h2load_rows() -> None:
    def row(name: str, seq: str, per_s: float, target: str = "server") -> dict[str, object]:
        return {
            "group": "unpinned",
            "target": target,
            "name": name,
            "seq": seq,
            "api": "v2",
            "pinned": False,
            "sequences_per_s": per_s,
        }

    rows = [
        row("in-process", "16", 2000.0, "in-process"),
        # The load generator's echo row comes first: its ceiling must not be the one taken.
        row(report.unpinned_name(1, "echo"), "16", 6000.0, "echo"),
        row(report.unpinned_name(1), "16", 1500.0),
        row(report.unpinned_name(2), "16", 1600.0),
        row(report.unpinned_h2load_name(1, "echo"), "16", 11000.0, "echo"),
        row(report.unpinned_h2load_name(1), "16", 1800.0),
        row(report.unpinned_h2load_name(2, "echo"), "16", 12000.0, "echo"),
        row(report.unpinned_h2load_name(2), "16", 1900.0),
        row(report.unpinned_h2load_name(1, "echo"), "128", 3000.0, "echo"),
    ]
    rows += report.ceiling_rows(rows)
    found = {r["name"]: r["value"] for r in ratios.unpinned(rows)}

    def ceiling(echo: float) -> float:
        return 1 / (1 / echo + 1 / 2000.0)

    assert found["unpinned seq 16 --frontends 1: h2load, echo floor req/s"] == 11000.0
    assert found["unpinned seq 16 --frontends 1: h2load, server / in-process"] == 0.9
    assert found["unpinned seq 16 --frontends 1: h2load, server / ceiling"] == pytest.approx(
        1800.0 / ceiling(11000.0)
    )
    assert found["unpinned seq 16 --frontends 2: h2load, server / ceiling"] == pytest.approx(
        1900.0 / ceiling(12000.0)
    )
    # An echo row without its server's (seq 128, and no in-process limit there): the
    # server's ratios are not measured, not invented.
    assert found["unpinned seq 128 --frontends 1: h2load, echo floor req/s"] == 3000.0
    assert found["unpinned seq 128 --frontends 1: h2load, server / in-process"] is None
    assert found["unpinned seq 128 --frontends 1: h2load, server / ceiling"] is None
    # Where no h2load row exists (--frontends 2 at seq 128 here), no line claims one.
    assert not any(name.startswith("unpinned seq 128 --frontends 2: h2load") for name in found)


def test_plots_leave_out_every_h2load_row() -> None:
    from bench import plots  # matplotlib, only here

    rows = [
        {"group": "unpinned", "name": report.unpinned_h2load_name(1), "p99_ms": 1.0, "requests": 5},
        {"group": report.H2LOAD, "name": "server", "p99_ms": 1.0, "requests": 5},
        {"group": "unpinned", "name": report.unpinned_name(1), "p99_ms": 1.0, "requests": 5},
    ]
    assert [r["name"] for r in plots.load_rows({"rows": rows})] == [report.unpinned_name(1)]


def test_an_idle_front_end_is_noted() -> None:
    runner = FakeRunner(_config())
    runner._check_spread(
        {"server_cpu_by_process_s": {"frontend-0": 2.0, "frontend-1": 0.01, "worker": 3.0}},
        "unpinned/x",
    )
    runner._check_spread({"server_cpu_by_process_s": {"frontend-0": 2.0, "frontend-1": 1.5}}, "y")
    runner._check_spread({"server_cpu_by_process_s": {"frontend-0": 2.0, "worker": 0.0}}, "z")
    # A gateway's CPU is its front end's: one front end, however its work is split.
    runner._check_spread(
        {"server_cpu_by_process_s": {"frontend-0": 0.01, "frontend-0-gateway": 2.0}}, "g"
    )
    assert len(runner.notes) == 1
    assert "unevenly" in runner.notes[0]
    assert "frontend-1 0%" in runner.notes[0]


def test_a_failed_row_among_measured_ones_reads_not_measured() -> None:
    rows = _rows()
    rows[2] = {**rows[2], **failed_result("server died")}  # the server at seq 16
    rows.append({**rows[2], "group": "batching", "name": "batching on", "load": "c=1"})
    found = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"headline", "batching"})}
    assert found["seq 16 v2: server / in-process"]["value"] is None
    assert found["seq 16 c=1: server p50 - in-process call (ms)"]["met"] is None
    assert scenarios.capacity_of(rows[2]) == 0.0
    assert scenarios.capacity_of({"requests_per_s": 812.5}) == 812.5


def test_no_pin_ratios_come_from_unpinned_rows() -> None:
    rows = [{**row, "pinned": False} for row in _rows()]
    rows += report.ceiling_rows(rows)
    found = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"headline"}, pinned=False)}
    value = found["seq 16 v2: server / stack ceiling"]["value"]
    assert value == pytest.approx(1500.0 / stack_ceiling(4000.0, 3000.0))
    assert found["seq 16 v2: server / in-process"]["value"] == pytest.approx(0.5)
    pinned_view = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"headline"})}
    assert pinned_view["seq 16 v2: server / stack ceiling"]["value"] is None


def test_grouping_off_is_first_come_or_a_noted_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    name, flags, note = scenarios.grouping_off(True)
    # First-come at the loose bound of the "grouping on, pad 0.5" row it is compared with.
    assert (name, flags, note) == (
        report.GROUPING_OFF,
        ["--length-grouping", "off", "--max-padding-ratio", "0.5"],
        "",
    )
    name, flags, note = scenarios.grouping_off(False)
    assert name == report.GROUPING_OFF_FALLBACK
    assert flags == ["--max-padding-ratio", "1.0"]
    assert "--length-grouping" in note
    monkeypatch.setattr(scenarios, "server_has_flag", lambda flag: False)
    runner = FakeRunner(_config())
    scenarios.other_servers(runner, {"mixed"})
    assert runner.servers == [
        (report.GROUPING_ON_LOOSE, ["--max-padding-ratio", "0.5"]),
        (report.GROUPING_OFF_FALLBACK, ["--max-padding-ratio", "1.0"]),
    ]
    assert any("--length-grouping" in note for note in runner.notes)
    rows = [
        {**row, "group": "mixed", "name": report.GROUPING_ON, "sequences_per_s": 240.0}
        for row in _rows()[1:2]
    ]
    rows.append({**rows[0], "name": report.GROUPING_ON_LOOSE, "sequences_per_s": 200.0})
    rows.append({**rows[0], "name": report.GROUPING_OFF_FALLBACK, "sequences_per_s": 100.0})
    found = {r["name"]: r for r in ratios.mixed(rows)}
    # Grouping on and off both at the loose bound; the default's bound against it.
    assert found["mixed: grouping on / pad 1.0 (fallback)"]["value"] == 2.0
    assert found["mixed: padding bound auto / 0.5"]["value"] == 1.2


def test_server_has_flag_reads_the_help(monkeypatch: pytest.MonkeyPatch) -> None:
    help_text = (
        "usage: python -m service [--max-batch-size N]\n  --length-grouping LENGTH_GROUPING\n"
    )
    done = subprocess.CompletedProcess([], 0, stdout=help_text, stderr="")
    monkeypatch.setattr(scenarios.subprocess, "run", lambda *a, **k: done)
    scenarios.server_has_flag.cache_clear()
    try:
        assert scenarios.server_has_flag("--length-grouping")
        assert not scenarios.server_has_flag("--length-group")
    finally:
        scenarios.server_has_flag.cache_clear()


def test_scenario_flags_come_last_and_overrides_are_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(server_flags=("--max-batch-size=8", "--max-queue-delay-ms", "2"))
    runner = Runner(config, scratch=Path("unused"))
    command = runner.server_command(["--max-batch-size", "1"], config.pinning)
    assert command[-2:] == ["--max-batch-size", "1"]  # the scenario's word is the last
    assert command.index("--max-batch-size=8") < command.index("--max-batch-size")
    assert overridden_flags(config.server_flags, ["--max-batch-size", "1"]) == ["--max-batch-size"]
    assert overridden_flags(config.server_flags, ["--length-grouping=off"]) == []

    class NoProcess:
        def __init__(self, name: str, command: list[str], env: object = None) -> None:
            self.pid, self.target = 0, "-"

        def __enter__(self) -> NoProcess:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def wait_ready(self, timeout_s: float) -> None:
            return None

    monkeypatch.setattr("bench.runner.Service", NoProcess)
    with runner.server("batching off", ["--max-batch-size", "1"], config.pinning):
        pass
    with runner.server("batching on", [], config.pinning):
        pass
    assert len(runner.notes) == 1
    assert "batching off" in runner.notes[0]
    assert "--max-batch-size" in runner.notes[0]


def test_inprocess_feeds_a_float16_graph_in_float16(tmp_path: Path) -> None:
    export = run_export(
        ExportRequest(name="half", embed_dim=16, num_heads=2, dtype="float16", out=tmp_path)
    )
    for graph, outputs in (
        (export.files.output_only, ["output"]),
        (export.files.with_weights, ["output", "attention_weights"]),
    ):
        sess = inprocess.session(graph, 1, "cpu")
        assert inprocess.input_dtypes(sess)["embeddings"] == np.float16
        sweep = inprocess.batch_sweep(sess, 4, [1, 2], outputs, 0.0)
        assert sweep["sequences_per_s"] > 0
        mixed = inprocess.mixed(sess, Lengths.parse("uniform:2:6"), 8, outputs, 0.0)
        assert set(mixed["strategies"]) == {"alone", "sorted by length, b=8", "first-come, b=32"}
    feeds = inprocess.padded_feeds([np.ones((2, 3), np.float32)], 3, inprocess.input_dtypes(sess))
    assert feeds["embeddings"].dtype == np.float16
    assert feeds["key_padding_mask"].dtype == np.bool_


def test_rejections_by_the_load_generator_are_apart_from_server_errors() -> None:
    base = _rows()[2]
    open_row = {
        **base,
        "group": "open",
        "name": "120% of capacity",
        "load": "rate=1800",
        "errors": {"UNAVAILABLE": 2},
        "rejected": 5,
        "config": {"loop": "open"},
    }
    table = report.format_table([open_row]).splitlines()
    header, line = table[0].split(), table[1].split()
    assert header[-3:] == ["err", "rej", "client"]
    assert line[-3:] == ["2", "5", "50%"]  # failed by the server, rejected by the client
    found = {r["name"]: r["value"] for r in ratios.all_ratios([open_row], "v2", {"open"})}
    assert found["open 120% of capacity: rejected by load generator"] == 5
    assert found["open 120% of capacity: failed by server"] == 2
    text = ratios.format_ratios(ratios.open_loop([open_row]))
    assert "rejected by load generator" in text
    assert "failed by server" in text
    said = describe(open_row)
    assert "rejected by the load generator 5" in said
    assert "failed by the server 2" in said


# -- peers: Triton set up or FAILED, and the targets against it -------------------------------


@pytest.mark.parametrize("interpreter", ["/nonexistent/python3.11", "/bin/false"])
def test_triton_peer_that_cannot_be_built_is_failed_rows(tmp_path: Path, interpreter: str) -> None:
    runner = FakeRunner(_config())
    triton.run(runner, venv=tmp_path / "venv", interpreter=Path(interpreter))
    assert [(row["target"], row["seq"]) for row in runner.rows] == [
        ("triton", "16"),
        ("triton", "128"),
        ("triton", report.MIXED),
    ]
    assert all(row["failed"] and row["group"] == "peers" for row in runner.rows)
    reason = runner.rows[0]["failed"]
    assert ("not found" in reason) if interpreter.startswith("/nonexistent") else "exited" in reason
    assert any("triton: not measured" in note for note in runner.notes)
    table = report.format_table(runner.rows)
    assert table.count("FAIL") == 2 * len(runner.rows)
    found = {r["name"]: r for r in ratios.peers(runner.rows, "v2")}
    assert found["seq 16: server / triton (seq/s)"]["met"] is None  # not measured, not MISSED


def test_side_by_side_rounds_give_the_median_ratio_and_its_range() -> None:
    def row(target: str, round_: int, seq: str, value: float) -> dict:
        who = "server" if target == "server" else "triton b=32 delay=0us"
        return {
            "group": report.HEAD_TO_HEAD,
            "target": target,
            "seq": seq,
            "api": "v2",
            "name": triton.round_name(who, round_),
            "sequences_per_s": value,
        }

    rows = [
        row("server", 1, "16", 1300.0),
        row("triton", 1, "16", 1000.0),
        row("triton", 2, "16", 1000.0),
        row("server", 2, "16", 1100.0),
        row("server", 3, "16", 1500.0),
        row("triton", 3, "16", 1000.0),
        row("triton", 4, "16", 1000.0),
        row("server", 4, "16", 1200.0),
        row("server", 1, "128", 150.0),
        {**row("triton", 1, "128", 0.0), "failed": "x"},
        row("server", 2, "128", 150.0),
        row("triton", 2, "128", 100.0),
    ]
    found = {r["name"]: r for r in ratios.head_to_head(rows)}
    median = found["seq 16: server / triton, side by side (4 rounds 1.10..1.50)"]
    assert median["value"] == pytest.approx(1.25)
    assert median["met"] is False  # 1.25 < 1.3
    partial = found["seq 128: server / triton, side by side (1 rounds 1.50..1.50)"]
    assert partial["value"] == pytest.approx(1.5)
    assert partial["met"] is None  # a round failed: no verdict from the rest
    missing = found["mixed: server / triton, side by side (0 rounds none)"]
    assert (missing["value"], missing["met"]) == (None, None)  # shown as not measured


def test_side_by_side_rounds_alternate_who_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    class Up:
        pid = 1

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...
        def __enter__(self) -> Up:
            return self

        def __exit__(self, *exc: object) -> None: ...
        def wait_ready(self, *args: Any, **kwargs: Any) -> None: ...

    @contextmanager
    def ours(name: str, flags: Sequence[str], pinning: Pinning, env: Any = None) -> Iterator[Up]:
        yield Up()

    monkeypatch.setattr(triton, "Service", Up)
    runner = FakeRunner(_config())
    monkeypatch.setattr(runner, "server", ours)
    triton.head_to_head(runner, Path("/venv/bin/python"), 0)
    order = [(row["seq"], row["target"]) for row in runner.rows]
    rounds = report.HEAD_TO_HEAD_ROUNDS
    assert len(order) == rounds * len(triton.LENGTHS) * 2
    firsts = [order[i][1] for i in range(0, len(order), 2)]
    assert firsts.count("server") == firsts.count("triton")  # each goes first as often
    assert all(order[i][0] == order[i + 1][0] for i in range(0, len(order), 2))  # same length
    assert {row["name"] for row in runner.rows} >= {
        "server, round 1",
        "triton b=32 delay=0us, round 4",
    }


def test_the_side_by_side_triton_is_the_delay_that_won_most_lengths() -> None:
    runner = FakeRunner(_config())
    for delay, served in ((0, (900.0, 140.0, 80.0)), (1000, (950.0, 120.0, 70.0))):
        for seq, value in zip(triton.LENGTHS, served, strict=True):
            runner.rows.append(
                {
                    "group": "peers",
                    "target": "triton",
                    "seq": seq,
                    "name": triton.config_name(delay),
                    "sequences_per_s": value,
                }
            )
    assert triton.best_delay(runner) == 0
    failed = FakeRunner(_config())
    triton.failed_rows(failed, "triton", "no venv")
    assert triton.best_delay(failed) is None  # then no side-by-side rounds run


def test_a_peer_that_fails_to_set_up_costs_its_rows_not_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench.peers import mlserver

    def broken(r: Runner) -> None:
        raise subprocess.CalledProcessError(1, ["pip", "install", "mlserver==1.7.1"])

    ran: list[Runner] = []
    monkeypatch.setattr(mlserver, "run", broken)
    monkeypatch.setattr(triton, "run", lambda r, shm, with_h2load: ran.append(r))
    runner = FakeRunner(_config())
    scenarios.peers(runner)
    assert ran == [runner]  # Triton still ran
    assert [(row["target"], row["seq"]) for row in runner.rows] == [
        ("mlserver", "16"),
        ("mlserver", "128"),
    ]
    assert "exit status 1" in runner.rows[0]["failed"]


def test_triton_command_is_pinned_with_one_thread_and_its_own_ports(tmp_path: Path) -> None:
    runner = Runner(_config(model_path=tmp_path / "model.onnx"), scratch=tmp_path)
    command, grpc_port = triton.serve_command(runner, Path("/venv/bin/python"), 1000)
    assert command[:3] == ["taskset", "-c", "1"]
    flags = dict(itertools.pairwise(command))
    assert flags["--threads"] == "1"
    assert (flags["--max-batch-size"], flags["--max-queue-delay-us"]) == ("32", "1000")
    assert flags["--grpc-port"] == str(grpc_port)
    assert len({flags["--grpc-port"], flags["--http-port"], flags["--metrics-port"]}) == 3
    assert triton.config_name(0) == "triton b=32 delay=0us"


def test_targets_against_triton_mlserver_and_two_front_ends() -> None:
    rows = _rows()
    triton_row = {
        **rows[3],
        "target": "triton",
        "name": "triton b=32 delay=0us",
        "sequences_per_s": 1000.0,
        "p99_ms": 1.0,
    }
    slower = {**triton_row, "name": "triton b=32 delay=1000us", "sequences_per_s": 900.0}
    mixed_server = {
        **rows[2],
        "group": "mixed",
        "name": report.GROUPING_ON,
        "seq": report.MIXED,
        "sequences_per_s": 300.0,
    }
    mixed_triton = {**triton_row, "seq": report.MIXED, "sequences_per_s": 150.0}
    unpinned = [
        {
            **rows[2],
            "group": "unpinned",
            "pinned": False,
            "seq": seq,
            "name": report.unpinned_name(n),
            "sequences_per_s": value,
        }
        for seq, n, value in (("16", 1, 1600.0), ("16", 2, 2000.0))
    ]
    c1 = {**rows[2], "load": "c=1", "p50_ms": 0.8, "sequences_per_s": 700.0}
    rows += [triton_row, slower, mixed_server, mixed_triton, *unpinned, c1]
    found = {r["name"]: r for r in ratios.all_ratios(rows, "v2", {"headline", "peers", "unpinned"})}
    assert found["seq 16: server / triton b=32 delay=0us (seq/s)"]["value"] == 1.5  # the best
    assert found["seq 16: server / triton b=32 delay=0us (seq/s)"]["met"] is True
    assert found["seq 16: server p99 / triton p99"]["met"] is False  # 2.0 ms vs 1.0 ms
    assert found["mixed: server / triton b=32 delay=0us (seq/s)"]["value"] == 2.0
    assert found["seq 16: server / mlserver b=8 (seq/s)"]["target"] == ">= 3.0"
    assert found["unpinned seq 16: --frontends 2 / --frontends 1"]["value"] == 1.25
    assert found["unpinned seq 16: --frontends 2 / --frontends 1"]["met"] is True
    assert "seq 16 c=1: batching on / off" not in found  # no batching group: only the p50 gap
    c1_gap = found["seq 16 c=1: server p50 - in-process call (ms)"]
    assert c1_gap["value"] == pytest.approx(0.3)
    assert found["seq 16 v2: server / in-process"]["value"] == 0.5  # the c=64 row, not c=1
    listed = ratios.targets(list(found.values()))
    assert listed
    assert all(item["target"] for item in listed)
    assert "seq 16: server / triton b=32 delay=0us (seq/s)" in {item["name"] for item in listed}


# -- the echo floor: the real server with the echo model -------------------------------------


def test_echo_model_keeps_the_graph_contract(tmp_path: Path) -> None:
    folder = echo_model.write_repository(tmp_path, "mha", 16, 2)
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx", "model.with_weights.onnx"]
    sess = inprocess.session(folder / "model.with_weights.onnx", 1, "cpu")
    assert [i.name for i in sess.get_inputs()] == ["embeddings", "key_padding_mask"]
    meta = sess.get_modelmeta().custom_metadata_map
    assert (meta["embed_dim"], meta["num_heads"], meta["dtype"]) == ("16", "2", "float32")
    x = np.random.default_rng(0).standard_normal((3, 5, 16), dtype=np.float32)
    output, weights = sess.run(None, {"embeddings": x, "key_padding_mask": np.zeros((3, 5), bool)})
    assert np.array_equal(output, x)
    assert weights.shape == (3, 2, 5, 5)
    assert not weights.any()


def test_echo_floor_is_the_real_server_with_the_passthrough_flags(tmp_path: Path) -> None:
    config = _config(model_repository=tmp_path / "models", server_flags=("--frontends=2",))
    runner = Runner(config, scratch=tmp_path)
    repository = runner.echo_repository()
    command = runner.server_command(["--frontends", "1"], config.pinning, repository)
    assert command[command.index("-m") + 1] == "service"
    assert command[command.index("--model-repository") + 1] == str(repository)
    assert command[-3:] == ["--frontends=2", "--frontends", "1"]
    assert (repository / "mha" / "1" / "model.onnx").is_file()
    assert runner.echo_repository() == repository  # made once per run
    plain = runner.server_command([], config.pinning)
    assert plain[plain.index("--model-repository") + 1] == str(tmp_path / "models")


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("echo-repository")
    echo_model.write_repository(repository, "mha", 16, 2)
    # A small stream bound, so the streaming runs below (4 callers) meet the back-pressure.
    with ServerProcess(
        repository,
        "--max-stream-inflight-requests",
        "2",
        "--intra-op-threads",
        "1",
        "--client-shared-memory",
        "on",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def echo_server_in_mode(echo_server: ServerProcess, grpc_gateway: str) -> Iterator[ServerProcess]:
    """The echo server in each gateway mode (the runs of the load generator below, which test
    the bench's own code, take it in one)."""
    with in_mode(echo_server, grpc_gateway) as server:
        yield server


def test_real_server_serves_the_echo_model_exactly(echo_server_in_mode: ServerProcess) -> None:
    x = np.random.default_rng(1).standard_normal((2, 7, 16), dtype=np.float32)
    request = v2.ModelInferRequest(
        model_name="mha",
        inputs=[
            v2.ModelInferRequest.InferInputTensor(
                name="embeddings", datatype="FP32", shape=[2, 7, 16]
            )
        ],
        outputs=[
            v2.ModelInferRequest.InferRequestedOutputTensor(name=name)
            for name in ("output", "attention_weights")
        ],
        raw_input_contents=[x.tobytes()],
    )
    with grpc.insecure_channel(echo_server_in_mode.target) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(request, timeout=30)
        metadata = stub.ModelMetadata(v2.ModelMetadataRequest(name="mha"), timeout=30)
    shapes = {o.name: list(o.shape) for o in reply.outputs}
    assert shapes == {"output": [2, 7, 16], "attention_weights": [2, 2, 7, 7]}
    contents = dict(zip((o.name for o in reply.outputs), reply.raw_output_contents, strict=True))
    assert contents["output"] == x.tobytes()  # the input, bit for bit
    assert contents["attention_weights"] == bytes(2 * 2 * 7 * 7 * 4)
    assert [i.name for i in metadata.inputs] == ["embeddings"]
    assert "served without a load-time check" in echo_server_in_mode.log  # no golden.npz: said so


@pytest.mark.parametrize(
    ("api", "extra"),
    [
        ("attention", ["--weights-fraction", "0.5"]),
        ("v2_stream", ["--seq", "uniform:2:9"]),
        ("attention_stream", ["--weights-fraction", "0.5"]),
        ("v2", ["--rate", "200", "--max-outstanding", "4"]),
        ("v2_shm", ["--seq", "uniform:2:9"]),
    ],
)
def test_loadgen_against_echo_server_writes_json(
    echo_server: ServerProcess, tmp_path: Path, api: str, extra: list[str]
) -> None:
    out = tmp_path / "result.json"
    roles = [f"--cpu-process={role}={pid}" for role, pid in child_pids(echo_server).items()]
    objects_before = set(os.listdir("/dev/shm"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.loadgen",
            "--target",
            echo_server.target,
            "--api",
            api,
            "--embed-dim",
            "16",
            "--concurrency",
            "4",
            "--duration-s",
            "0.8",
            "--warmup-s",
            "0.2",
            "--cpu-pid",
            str(echo_server.process.pid),
            "--json",
            str(out),
            *roles,
            *extra,
        ],
        check=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    result = json.loads(out.read_text())
    assert result["config"]["api"] == api
    assert set(os.listdir("/dev/shm")) <= objects_before  # v2_shm: its regions removed
    assert result["requests"] > 0
    assert result["errors"] == {}
    assert result["sequences_per_s"] == pytest.approx(result["requests_per_s"])
    assert result["p50_ms"] <= result["p99_ms"] <= result["p99.9_ms"]
    assert result["server_cpu_s"] >= 0
    each = result["server_cpu_by_process_s"]
    assert {"worker", "frontend-0", "supervisor", "other"} <= set(each)
    assert sum(each.values()) == pytest.approx(result["server_cpu_s"], abs=0.05)
    assert result["client_cpu_us_per_request"] > 0
    assert "main" in result["server_cpu_us_per_request_by_thread"]["worker"]
    if api.startswith("attention"):  # AttentionService responses carry the batch sizes
        sizes = result["response_timing"]["requests_by_batch_size"]
        assert sum(sizes.values()) == result["requests"]


# One mode: bench.worker_alone talks to the worker, never to the gRPC port.
def test_the_worker_alone_is_driven_over_its_own_channel(model_repository: Path) -> None:
    """bench.worker_alone connects as one more front end and measures the worker's CPU."""
    with ServerProcess(model_repository) as server:
        args = worker_alone.parse_args(
            ["--supervisor-pid", str(server.process.pid), "--burst", "4", "--rounds", "200"]
        )
        result = asyncio.run(worker_alone.measure(args))
        assert result["requests"] == 800
        assert result["worker_cpu_us_per_request"] > 0


def test_the_worker_parts_are_timed_in_one_process(model_repository: Path) -> None:
    """bench.worker_parts times ONNX Runtime's run and the batcher around it."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.worker_parts",
            "--model-repository",
            str(model_repository),
            "--requests",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["model"], result["requests"]) == ("mha/1", 50)
    assert 0 < result["onnx_runtime_run_us"] < result["batcher_one_at_a_time_us"]


def test_the_floor_of_a_python_worker_loop_is_timed_against_a_stand_in(
    model_repository: Path,
) -> None:
    """bench.worker_floor runs the bare loop and its stand-in in two processes."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.worker_floor",
            "--model-repository",
            str(model_repository),
            "--requests",
            "50",
            "--cpu",
            "0",
            "--client-cpu",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["model"], result["seq"], result["requests"]) == ("mha/1", 16, 50)
    assert result["loop_cpu_us_per_request"] > 0
    assert result["onnx_runtime_run_us_in_place"] > 0
    assert result["requests_per_s"] > 0
