"""A child's standard error relayed into log lines: gRPC core's and ONNX Runtime's layouts
read back as records, and the relay reading a real process's descriptor 2 (its last words
included, a line it never ended too)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from service.app import stderr_relay
from service.app.stderr_relay import MAX_LINE_BYTES, StderrRelay
from service.observability import stray_lines
from service.observability.logs import LineFormatter
from service.observability.stray_lines import MAX_RECORD_COST, StrayRecord, json_cost

ROOT = Path(__file__).resolve().parents[2]
GRPC_LINE = b"E1206 17:49:28.729614   25002 call.cc:361] Compression algorithm 'gzip' is disabled."
# As ONNX Runtime 1.31 writes a warning: in colours, its logger id empty.
ORT_LINE = (
    b"\x1b[0;93m2026-12-06 18:22:49.400441111 [W:onnxruntime:, graph.cc:5777 "
    b"CleanUnusedInitializersAndNodeArgs] Removing initializer 'unused'. It is not used by any "
    b"node and should be removed from the model.\x1b[m"
)


def test_grpc_core_and_onnx_runtime_lines_keep_their_level_and_source() -> None:
    assert stray_lines.parse(GRPC_LINE) == StrayRecord(
        "grpc.core", logging.ERROR, "Compression algorithm 'gzip' is disabled. (call.cc:361)"
    )
    assert stray_lines.parse(ORT_LINE) == StrayRecord(
        "onnxruntime",
        logging.WARNING,
        "Removing initializer 'unused'. It is not used by any node and should be removed from "
        "the model. (graph.cc:5777 CleanUnusedInitializersAndNodeArgs)",
    )
    # An error's colour reset on a line of its own is no line; absl's time before it is set.
    assert stray_lines.records(
        [b"\x1b[1;31m2026-12-06 18:22:49.4 [E:onnxruntime:, x.cc:1 F] bad", b"\x1b[m"]
    ) == [StrayRecord("onnxruntime", logging.ERROR, "bad (x.cc:1 F)")]
    early = b"W0000 00:00:1733507368.729614   77 init.cc:5] early"
    assert stray_lines.parse(early) == StrayRecord(
        "grpc.core", logging.WARNING, "early (init.cc:5)"
    )
    info = b"I0101 00:00:00.000001      1 ev_epoll1_linux.cc:123] using polling engine"
    assert stray_lines.parse(info) == StrayRecord(
        "grpc.core", logging.INFO, "using polling engine (ev_epoll1_linux.cc:123)"
    )
    assert stray_lines.parse(b"Traceback (most recent call last):") is None


def _json_line(record: StrayRecord) -> str:
    """The record as the supervisor writes it with --log-format json."""
    line = logging.LogRecord(
        record.logger, record.level, __file__, 1, "%s", (record.message,), None
    )
    line.relayed_from = "frontend-1"
    return LineFormatter("supervisor", "json").format(line)


@pytest.mark.parametrize(
    "text",
    ["é" * 3000, "\U0001f600" * 3000, "\x01" * 5000, "\\" * 5000, '"' * 5000, "中" * 3000],
    ids=["accented", "emoji", "control", "backslash", "quote", "cjk"],
)
def test_no_json_line_outgrows_one_atomic_pipe_write(text: str) -> None:
    """A long line, whatever its characters cost escaped, is logged in pieces of the line's
    logger and level, each JSON line well within the 4096 bytes a pipe writes whole."""
    for prefix, logger in (
        (b"E1206 17:49:28.729614   25002 call.cc:361] ", "grpc.core"),
        (b"", "stderr"),
    ):
        pieces = stray_lines.records([prefix + text.encode()])
        assert {r.logger for r in pieces} == {logger}
        assert all(json_cost(r.message) <= MAX_RECORD_COST for r in pieces)
        assert max(len(_json_line(r).encode()) for r in pieces) < 4096
        joined = "".join(r.message for r in pieces)
        assert joined.startswith(text)
    not_utf8 = stray_lines.records([b"\xff" * 5000])
    assert max(len(_json_line(r).encode()) for r in not_utf8) < 4096
    assert "".join(r.message for r in not_utf8) == "\\xff" * 5000


def test_runs_of_other_lines_end_at_the_bound() -> None:
    run = stray_lines.records([b"a" * 1500, b"b" * 1500, b"c" * 5000])
    assert [len(r.message) for r in run] == [1500, 1500, 2048, 2048, 904]
    assert all(r.logger == "stderr" for r in run)
    # Control sequences other than colours go too; a line of nothing else is no line.
    assert stray_lines.records([b"\x1b[K\x1b[2J" * 100]) == []


def test_other_lines_are_one_error_record_per_run() -> None:
    lines = [
        b"Fatal Python error: Segmentation fault",
        b"",
        b"Current thread 0x00007f (most recent call first):",
        GRPC_LINE,
        b'  File "x.py", line 1 in <module>\xff',
    ]
    assert stray_lines.records(lines) == [
        StrayRecord(
            "stderr",
            logging.ERROR,
            "Fatal Python error: Segmentation fault\nCurrent thread 0x00007f (most recent call "
            "first):",
        ),
        stray_lines.parse(GRPC_LINE),
        StrayRecord("stderr", logging.ERROR, '  File "x.py", line 1 in <module>\\xff'),
    ]


# A child as the supervisor starts it: descriptor 2 attached to the relay's FIFO, its log
# records on the original standard error; then native-style writes and an unended line.
CHILD = """
import logging, os, sys
from pathlib import Path
from service.app import stderr_relay
from service.observability import logs
original = stderr_relay.attach(Path(sys.argv[1]), "frontend-3")
assert original is not None
logs.configure("frontend-3", logs.LogState("INFO", "json"), output_fd=original)
logging.getLogger("service.child").info("a record of its own")
import numpy as np, onnx.helper as h, onnxruntime
from onnx import TensorProto, numpy_helper
graph = h.make_graph(
    [h.make_node("Identity", ["x"], ["y"])], "g",
    [h.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    [h.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    initializer=[numpy_helper.from_array(np.ones(1, np.float32), "unused")],
)
model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
model.ir_version = 8
onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
os.write(2, sys.argv[2].encode() + b"\\n")
os.write(2, b"Traceback (most recent call last):\\n  boom\\n")
os.write(2, b"x" * int(sys.argv[3]) + b"last words, no newline")
os._exit(3)
"""


@pytest.fixture
def relayed(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


def test_the_relay_logs_a_childs_stderr_as_that_childs_records(
    tmp_path: Path, relayed: pytest.LogCaptureFixture
) -> None:
    long = MAX_LINE_BYTES + 10

    async def main() -> subprocess.CompletedProcess[bytes]:
        relay = StderrRelay(tmp_path, "frontend-3")
        relay.start()
        child = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", CHILD, str(tmp_path), GRPC_LINE.decode(), str(long)],
            capture_output=True,
            cwd=ROOT,
        )
        relay.close()
        return child

    child = asyncio.run(main())
    assert child.returncode == 3, child.stderr
    # Its own record went straight to its original standard error, as JSON.
    own = json.loads(child.stderr.decode().strip())
    assert own["process"] == "frontend-3"
    assert own["message"] == "a record of its own"
    records = [r for r in relayed.records if getattr(r, "relayed_from", None) == "frontend-3"]
    assert [(r.name, r.levelno) for r in records[:3]] == [
        ("onnxruntime", logging.WARNING),
        ("grpc.core", logging.ERROR),
        ("stderr", logging.ERROR),
    ]
    assert "Removing initializer 'unused'" in records[0].getMessage()
    assert records[1].getMessage() == "Compression algorithm 'gzip' is disabled. (call.cc:361)"
    assert records[2].getMessage() == "Traceback (most recent call last):\n  boom"
    # The line it never ended: logged at its exit, in records no longer than the bound.
    rest = records[3:]
    assert {(r.name, r.levelno) for r in rest} == {("stderr", logging.ERROR)}
    assert rest[-1].getMessage().endswith("xlast words, no newline")
    assert "".join(r.getMessage() for r in rest).count("x") == long
    assert max(json_cost(r.getMessage()) for r in rest) <= MAX_RECORD_COST
    assert not (tmp_path / "stderr-frontend-3").exists()
    line = json.loads(LineFormatter("supervisor", "json").format(records[1]))
    assert line["process"] == "frontend-3"
    assert line["logger"] == "grpc.core"


def test_a_child_run_without_a_relay_keeps_its_stderr(tmp_path: Path) -> None:
    assert stderr_relay.attach(tmp_path, "worker") is None
