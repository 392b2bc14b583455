"""The benchmark suite's pure pieces, and one short end-to-end run against the echo server.
Nothing here asserts on speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import cputime, inprocess, ratios, report, scrape
from bench.launcher import REPO_ROOT, Pinning, Service, choose_pinning, cpu_count
from bench.payloads import (
    attend_stream_reply,
    attend_timing,
    build_payloads,
    fields,
    v2_stream_reply,
    with_id,
)
from bench.stats import (
    Lengths,
    bucket_counts,
    latency_summary_ms,
    percentile,
    poisson_arrivals,
    stack_ceiling,
)
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2

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
    payloads = build_payloads("attention", Lengths.parse("4"), embed_dim=8, sequences=1,
                              weights_fraction=0.5, model="mha")  # fmt: skip
    assert set(payloads) == {(4, False), (4, True)}
    request = pb.AttendRequest.FromString(with_id(payloads[4, True].body, "attention", b"r-7"))
    assert request.request_id == "r-7"
    assert list(request.embeddings.shape) == [4, 8]
    assert request.return_attention_weights


def test_prebuilt_v2_request_lists_outputs_only_for_weights() -> None:
    payloads = build_payloads("v2_stream", Lengths.parse("uniform:2:3"), embed_dim=4,
                              sequences=2, weights_fraction=1.0, model="m")  # fmt: skip
    assert set(payloads) == {(2, True), (3, True)}
    request = v2.ModelInferRequest.FromString(with_id(payloads[3, True].body, "v2", b"abc"))
    assert (request.id, request.model_name, list(request.inputs[0].shape)) == (
        "abc",
        "m",
        [2, 3, 4],
    )
    assert [o.name for o in request.outputs] == ["output", "attention_weights"]
    assert len(request.raw_input_contents[0]) == 2 * 3 * 4 * 4
    plain = build_payloads("v2", Lengths.parse("3"), embed_dim=4, sequences=1,
                           weights_fraction=0.0, model="m")  # fmt: skip
    assert not v2.ModelInferRequest.FromString(plain[3, False].body).outputs


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
        return {"group": "headline", "target": target, "name": name, "api": api, "seq": seq,
                "load": "c=64", "pinned": True, "sequences_per_s": value, "requests": 10,
                "p50_ms": 1.0, "p99_ms": 2.0, "p99.9_ms": 3.0, "errors": {}, "rejected": 0,
                "client_cpu_utilization": 0.5, "server_cpu_ms_per_request": 0.25, **extra}  # fmt: skip

    limit = {"group": "headline", "target": "in-process", "name": "in-process", "api": "-",
             "seq": "16", "load": "-", "pinned": True, "sequences_per_s": 3000.0, "threads": 1,
             "best": {"batch_size": 8, "sequences_per_s": 3000.0, "ms_per_batch": 2.67},
             "points": [{"batch_size": 1, "sequences_per_s": 2000.0, "ms_per_batch": 0.5}]}  # fmt: skip
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
    assert found["seq 16 v2: echo server CPU us per request"]["value"] == pytest.approx(250.0)
    assert found["seq 16: server / mlserver b=8 (seq/s)"]["value"] == pytest.approx(3.0)
    assert found["seq 16: server p99 / peer p99"]["value"] == pytest.approx(0.25)
    assert found["seq 128 v2: server / stack ceiling"]["value"] is None  # not measured


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


# -- end to end: load generator against the echo server ---------------------------------------


@pytest.fixture(scope="module")
def echo_server() -> Service:
    with Service("echo", [sys.executable, "-m", "bench.echo_server", "--embed-dim", "16",
                          "--num-heads", "2"]) as service:  # fmt: skip
        service.wait_ready(30)
        yield service


@pytest.mark.parametrize(
    ("api", "extra"),
    [("attention", ["--weights-fraction", "0.5"]), ("v2_stream", ["--seq", "uniform:2:9"]),
     ("v2", ["--rate", "200", "--max-outstanding", "4"])],
)  # fmt: skip
def test_loadgen_against_echo_server_writes_json(
    echo_server: Service, tmp_path: Path, api: str, extra: list[str]
) -> None:
    out = tmp_path / "result.json"
    subprocess.run(
        [sys.executable, "-m", "bench.loadgen", "--target", echo_server.target, "--api", api,
         "--embed-dim", "16", "--concurrency", "4", "--duration-s", "0.8", "--warmup-s", "0.2",
         "--cpu-pid", str(echo_server.pid), "--json", str(out), *extra],
        check=True, cwd=REPO_ROOT, timeout=60,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["api"] == api
    assert result["requests"] > 0
    assert result["errors"] == {}
    assert result["sequences_per_s"] == pytest.approx(result["requests_per_s"])
    assert result["p50_ms"] <= result["p99_ms"] <= result["p99.9_ms"]
    assert result["server_cpu_s"] >= 0
    if api == "attention":  # the echo server answers batch_size 1 in its timing
        assert result["response_timing"]["requests_by_batch_size"] == {"1": result["requests"]}
