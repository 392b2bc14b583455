"""Log lines (text and JSON), the log settings file every process follows, and Triton's log
settings mapped onto levels: units, no server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from service.errors import InvalidInput
from service.frontend import log_settings
from service.frontend.log_settings import LogControl, triton_view, updated
from service.generated.inference import grpc_service_pb2 as v2
from service.observability import logs
from service.observability.logs import LineFormatter, LogSettingsFile, LogState

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "log-settings.json"


def _record(message: str, *args: object, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("service.test", level, __file__, 1, message, args, None)


def test_json_lines_carry_the_fields_and_the_request_id() -> None:
    formatter = LineFormatter("frontend-2", "json")
    token = logs.REQUEST_ID.set("req-\n" + "x" * 500)
    try:
        line = formatter.format(_record("a %s\nsecond line", "message"))
    finally:
        logs.REQUEST_ID.reset(token)
    assert "\n" not in line  # one object per line, whatever the message holds
    record = json.loads(line)
    assert list(record)[:5] == ["time", "level", "process", "logger", "message"]
    assert record["level"] == "INFO"
    assert record["process"] == "frontend-2"
    assert record["logger"] == "service.test"
    assert record["message"] == "a message\nsecond line"
    assert record["request_id"] == ("req-\n" + "x" * 500)[:64]  # a client's string: bounded
    stamp = datetime.fromisoformat(record["time"])
    assert record["time"].endswith("Z")
    assert stamp.utcoffset() is not None
    assert "trace_id" not in record  # tracing is off


def _undecodable_header_record(exc_info: Any = None) -> logging.LogRecord:
    """gRPC's record of a metadata value that is not UTF-8 (a key, one stray byte apart)."""
    return logging.LogRecord(
        "grpc._cython.cygrpc",
        logging.ERROR,
        __file__,
        1,
        "Invalid encoding on %s",
        (b"secret-key\xff",),
        exc_info,
    )


@pytest.mark.parametrize("format_name", ["text", "json"])
def test_an_undecodable_header_value_grpc_logs_is_never_shown(format_name: str) -> None:
    """gRPC's Python layer logs a metadata value that is not UTF-8; a key, one stray byte
    apart, must not reach the log."""
    line = LineFormatter("frontend-0", format_name).format(_undecodable_header_record())
    assert "secret-key" not in line
    assert logs.HIDDEN_HEADER in line


@pytest.mark.parametrize("format_name", ["text", "json"])
def test_an_undecodable_header_value_is_not_shown_in_a_record_written_in_pieces(
    format_name: str,
) -> None:
    """The same record with a traceback long enough to be written in pieces."""
    read_end, write_end = os.pipe()
    handler = logs.LineHandler(write_end)
    handler.setFormatter(LineFormatter("frontend-0", format_name))
    try:
        raise ValueError("x" * 3 * logs.ATOMIC_WRITE_BYTES)
    except ValueError:
        record = _undecodable_header_record(sys.exc_info())
    handler.emit(record)
    os.close(write_end)
    with open(read_end, "rb") as pipe:
        written = pipe.read().decode()
    assert len(written.splitlines()) > 3  # in pieces
    assert "secret-key" not in written
    assert logs.HIDDEN_HEADER in written


def test_json_lines_hold_an_exception_and_no_request_id_outside_a_request() -> None:
    formatter = LineFormatter("worker", "json")
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    line = json.loads(formatter.format(record))
    assert "ValueError: boom" in line["exception"]
    assert "request_id" not in line


def test_text_lines_name_the_process_and_switch_format_at_run_time() -> None:
    formatter = LineFormatter("supervisor", "text")
    assert " INFO [supervisor] service.test: hello" in formatter.format(_record("hello"))
    formatter.use("json")
    assert json.loads(formatter.format(_record("hello")))["process"] == "supervisor"


def test_rfc3339_in_utc_to_the_microsecond() -> None:
    assert logs.rfc3339(0.25) == "1970-01-01T00:00:00.250000Z"
    assert logs.rfc3339(1767225600.999999) == "2026-01-01T00:00:00.999999Z"


def test_the_settings_file_bytes_the_gateway_reads() -> None:
    """tests/golden/log-settings.json is read by the Go gateway's tests too."""
    assert LogState("DEBUG", "json").to_json() == GOLDEN.read_bytes()
    assert LogState.from_json(GOLDEN.read_bytes()) == LogState("DEBUG", "json")
    for broken in (
        b"",
        b"{",
        b"[]",
        b'{"level": "LOUD", "format": "json"}',
        b'{"level": "INFO", "format": "xml"}',
        b'{"level": "INFO"}',
    ):
        assert LogState.from_json(broken) is None


def test_a_change_of_the_file_is_seen_once(tmp_path: Path) -> None:
    settings = LogSettingsFile(tmp_path)
    assert settings.changed() is None  # no file yet
    settings.write(LogState("INFO", "text"))
    assert settings.changed() == LogState("INFO", "text")
    assert settings.changed() is None
    settings.write(LogState("DEBUG", "json"))
    assert settings.changed() == LogState("DEBUG", "json")
    assert [path.name for path in tmp_path.iterdir()] == [logs.SETTINGS_FILE]


def test_follow_applies_each_change(tmp_path: Path) -> None:
    settings = LogSettingsFile(tmp_path)
    applied: list[LogState] = []

    async def main() -> None:
        seen = asyncio.Event()

        def on_change(state: LogState) -> None:
            applied.append(state)
            seen.set()

        following = asyncio.create_task(logs.follow(settings, on_change, interval_s=0.001))
        settings.write(LogState("ERROR", "json"))
        await asyncio.wait_for(seen.wait(), 10)
        following.cancel()

    asyncio.run(main())
    assert applied == [LogState("ERROR", "json")]


@pytest.fixture
def root_logging() -> object:
    """The root logger's handlers and level, restored after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logs.apply(LogState(logging.getLevelName(level), "text"))


def test_apply_sets_level_and_format_and_off_silences(
    root_logging: logging.Logger, capfd: pytest.CaptureFixture[str]
) -> None:
    logs.configure("worker", LogState("WARNING", "json"))
    log = logging.getLogger("service.unit")
    log.info("hidden")
    log.warning("shown")
    logs.apply(LogState("OFF", "json"))
    log.error("hidden too")
    lines = capfd.readouterr().err.splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["shown"]
    assert logs.current() == LogState("OFF", "json")


# -- Triton's log settings --------------------------------------------------------------------

INFO_TEXT = LogState("INFO", "text")


@pytest.mark.parametrize(
    ("level", "info", "warning", "error", "verbose"),
    [
        ("DEBUG", True, True, True, 1),
        ("INFO", True, True, True, 0),
        ("WARNING", False, True, True, 0),
        ("ERROR", False, False, True, 0),
        ("OFF", False, False, False, 0),
    ],
)
def test_levels_as_tritons_switches(
    level: str, info: bool, warning: bool, error: bool, verbose: int
) -> None:
    assert triton_view(LogState(level, "json")) == {
        "log_file": "",
        "log_info": info,
        "log_warning": warning,
        "log_error": error,
        "log_verbose_level": verbose,
        "log_format": "json",
    }


@pytest.mark.parametrize(
    ("start", "changes", "level"),
    [
        ("INFO", {"log_verbose_level": 1}, "DEBUG"),
        ("INFO", {"log_verbose_level": 3}, "DEBUG"),
        ("DEBUG", {"log_verbose_level": 0}, "INFO"),
        ("INFO", {"log_info": False}, "WARNING"),
        ("INFO", {"log_warning": False}, "ERROR"),  # turning one off turns off those below
        ("DEBUG", {"log_error": False}, "OFF"),
        ("OFF", {"log_warning": True}, "WARNING"),  # turning one on turns on those above
        ("WARNING", {"log_info": True, "log_verbose_level": 0}, "INFO"),
        ("ERROR", {"log_warning": True, "log_error": True}, "WARNING"),
        ("INFO", {"log_info": True}, "INFO"),
        ("DEBUG", {"log_info": True}, "DEBUG"),
        ("INFO", {}, "INFO"),
    ],
)
def test_tritons_switches_move_the_threshold(
    start: str, changes: dict[str, object], level: str
) -> None:
    assert updated(LogState(start, "text"), changes) == LogState(level, "text")


@pytest.mark.parametrize(
    ("changes", "format_name"),
    [
        ({"log_format": "json"}, "json"),
        ({"log_format": "text"}, "text"),
        ({"log_format": "default"}, "text"),
        ({"log_format": "ISO8601"}, "text"),
        ({"log_file": ""}, "json"),
    ],
)
def test_formats_and_the_log_file(changes: dict[str, object], format_name: str) -> None:
    assert updated(LogState("INFO", "json"), changes).format == format_name


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"log_info": True, "log_warning": False}, "more severe one is turned off"),
        ({"log_verbose_level": 1, "log_error": False}, "more severe one is turned off"),
        ({"log_level": "DEBUG"}, "unknown log setting 'log_level'"),
        ({"log_info": 1}, "log_info is 1; expected true or false"),
        ({"log_verbose_level": True}, "expected an integer >= 0"),
        ({"log_verbose_level": -1}, "expected an integer >= 0"),
        ({"log_verbose_level": "1"}, "expected an integer >= 0"),
        ({"log_format": "xml"}, "expected text or json"),
        ({"log_format": 1}, "expected text or json"),
        ({"log_file": "/var/log/x"}, "standard error"),
    ],
)
def test_what_is_refused(changes: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        updated(INFO_TEXT, changes)


def test_settings_as_tritons_protobuf_messages() -> None:
    request = v2.LogSettingsRequest()
    request.settings["log_info"].bool_param = False
    request.settings["log_verbose_level"].uint32_param = 0
    request.settings["log_format"].string_param = "json"
    assert log_settings.from_proto(request) == {
        "log_info": False,
        "log_verbose_level": 0,
        "log_format": "json",
    }
    request.settings["log_error"]  # named, without a value
    with pytest.raises(InvalidInput, match="'log_error' has no value"):
        log_settings.from_proto(request)
    answer = log_settings.to_proto(triton_view(LogState("DEBUG", "text")))
    assert answer.settings["log_verbose_level"].WhichOneof("parameter_choice") == "uint32_param"
    assert answer.settings["log_verbose_level"].uint32_param == 1
    assert answer.settings["log_info"].bool_param is True
    assert answer.settings["log_format"].string_param == "text"
    assert answer.settings["log_file"].WhichOneof("parameter_choice") == "string_param"


def test_a_change_is_written_for_every_process(
    tmp_path: Path, root_logging: logging.Logger
) -> None:
    logs.configure("frontend-0", LogState("INFO", "text"))
    LogSettingsFile(tmp_path).write(LogState("INFO", "text"))
    control = LogControl(tmp_path)
    view = control.update({"log_verbose_level": 1, "log_format": "json"}, "peer 'test'")
    assert view["log_verbose_level"] == 1
    assert LogSettingsFile(tmp_path).read() == LogState("DEBUG", "json")
    assert logs.current() == LogState("DEBUG", "json")  # this process at once
    assert control.view() == view


# -- lines whole in a shared pipe ---------------------------------------------------------------

# A process that logs tracebacks longer than a pipe's atomic write, as fast as it can, to
# the descriptor argv[4] names (in the given format); each message names the process and a
# counter.
_LONG_RECORDS = """
import logging, sys
from service.observability import logs
logs.configure(sys.argv[1], logs.LogState("INFO", sys.argv[2]), output_fd=int(sys.argv[4]))
log = logging.getLogger("service.flood")
def deep(n):
    if n == 0:
        raise ValueError("é" * 300 + "x" * 3000)
    deep(n - 1)
for i in range(int(sys.argv[3])):
    try:
        deep(40)
    except ValueError:
        log.exception("%s record %d", sys.argv[1], i)
"""


@pytest.mark.parametrize("format_name", ["json", "text"])
def test_long_records_from_processes_sharing_a_pipe_stay_whole(format_name: str) -> None:
    """Three processes log records of about 10 KiB (a deep traceback) into one pipe read
    slowly, as a container's standard error can be: every line read is one of theirs, whole
    (one JSON object; in text, a line of a known kind), and each process's text comes back
    complete and in order."""
    read_end, write_end = os.pipe()
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _LONG_RECORDS,
                f"frontend-{k}",
                format_name,
                "30",
                f"{write_end}",
            ],
            cwd=ROOT,
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
        )
        for k in range(3)
    ]
    os.close(write_end)
    received = bytearray()
    with open(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(512):  # small reads: the pipe stays full, writers wait
            received += chunk
    assert [writer.wait(timeout=60) for writer in writers] == [0, 0, 0]
    lines = received.decode().splitlines()
    # Each process's records' text (message, traceback), the pieces of a long one joined back.
    pieces: dict[str, list[list[str]]] = {f"frontend-{k}": [] for k in range(3)}
    for line in lines:
        assert len(line.encode()) < logs.ATOMIC_WRITE_BYTES, line[:200]
        if format_name == "json":
            record = json.loads(line)
            assert (record["level"], record["logger"]) == ("ERROR", "service.flood"), record
            pieces[record["process"]].append([record["message"]])
            continue
        header = re.match(r"\S+ \S+ ([A-Z]+) \[(frontend-\d)\] (\S+): ", line)
        if header is not None:
            assert (header[1], header[3]) == ("ERROR", "service.flood"), line[:200]
            current = pieces[header[2]]
            current.append([line[header.end() :]])
        else:  # a traceback's line, in the write that began with the last header
            current[-1].append(line)
    for process, written in pieces.items():
        text = "".join("\n".join(piece) for piece in written)
        assert text.count("Traceback (most recent call last)") == 30, process
        assert text.count("ValueError: " + "é" * 300 + "x" * 3000) == 30, process
        assert [int(n) for n in re.findall(rf"{process} record (\d+)", text)] == list(range(30))
