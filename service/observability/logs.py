"""Log lines of every process, as text or as JSON (one object per line), at a level and in a
format that can change while the server runs.

JSON lines carry time (RFC 3339, UTC), level, process (supervisor, worker, frontend-K;
the gateways write the same lines themselves), logger and message; inside a request also
its trace id, span id and request id where known; an exception's traceback in exception.

The level and format in force live in a small file of the run directory (LogSettingsFile):
the front end that takes a change writes it, and every process, the gateways included,
looks at it a few times a second and applies what it finds, so a change reaches them all
without a message between them, and a process that restarts starts with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.observability import stray_lines, tracing
from service.text import SHOWN_CHARS

FORMATS = ("text", "json")
# OFF: nothing at all (Triton's log settings can turn every level off).
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "OFF")
OFF = logging.CRITICAL + 10
SETTINGS_FILE = "log-settings.json"
FOLLOW_INTERVAL_S = 0.25  # how often each process looks at the settings file
TEXT_LAYOUT = "%(asctime)s %(levelname)s [%(process_role)s] %(name)s: %(message)s"

# One write of at most this many bytes to a pipe (a container's standard error) is atomic
# (POSIX's PIPE_BUF): no other process's line lands inside it, however full the pipe.
ATOMIC_WRITE_BYTES = 4096

log = logging.getLogger(__name__)
# A record's attribute naming the child whose standard error the supervisor relays it for.
RELAYED_FROM = "relayed_from"
# The id of the request a line is logged for ("" outside one); set by the front ends.
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")


@dataclass(frozen=True)
class LogState:
    """What every process logs: its level threshold (one of LEVELS) and format (FORMATS)."""

    level: str
    format: str

    def to_json(self) -> bytes:
        return json.dumps({"level": self.level, "format": self.format}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LogState | None:
        """The state a settings file holds; None when it holds no valid one."""
        try:
            fields = json.loads(raw)
            state = cls(str(fields["level"]).upper(), str(fields["format"]))
        except (ValueError, TypeError, KeyError):
            return None
        return state if state.level in LEVELS and state.format in FORMATS else None


def level_number(level: str) -> int:
    return OFF if level == "OFF" else logging.getLevelName(level)


def rfc3339(created: float) -> str:
    """A record's time as RFC 3339 in UTC, to the microsecond (as the gateway writes it)."""
    seconds = int(created)
    micros = int((created - seconds) * 1e6)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{micros:06d}Z"


# gRPC core's Python layer logs a metadata value that is not UTF-8 whole: with a key header
# (--restricted-api) that value may be a key, one stray byte apart. Its bytes are never shown.
_GRPC_UNDECODABLE = "Invalid encoding on %s"
HIDDEN_HEADER = "a header value that is not UTF-8 (not shown)"


def _without_header_values(record: logging.LogRecord) -> logging.LogRecord:
    if record.msg == _GRPC_UNDECODABLE and record.name.startswith("grpc"):
        record = logging.makeLogRecord(record.__dict__)
        record.args = (HIDDEN_HEADER,)
    return record


class LineFormatter(logging.Formatter):
    """TEXT_LAYOUT or one JSON object per line; use() switches between them at run time."""

    def __init__(self, process: str, format_name: str) -> None:
        super().__init__(TEXT_LAYOUT)
        self.process = process
        self.json = format_name == "json"

    def use(self, format_name: str) -> None:
        self.json = format_name == "json"

    def format(self, record: logging.LogRecord) -> str:
        record = _without_header_values(record)
        if self.json:
            return self._json(record)
        record.process_role = _process_of(record, self.process)
        return super().format(record)

    def _json(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": rfc3339(record.created),
            "level": record.levelname,
            "process": _process_of(record, self.process),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(request_fields(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, separators=(",", ":"))


def _process_of(record: logging.LogRecord, own: str) -> str:
    """The process a record speaks for: a child's, for a line of its standard error that the
    supervisor relays (RELAYED_FROM); else this one."""
    return str(getattr(record, RELAYED_FROM, None) or own)


def request_fields(record: logging.LogRecord) -> dict[str, str]:
    """trace_id, span_id and request_id of the request being served, where known."""
    fields = {}
    if tracing.enabled():
        fields.update(_span_ids())
    request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
    if request_id:
        fields["request_id"] = str(request_id)[:SHOWN_CHARS]  # a client's string: bounded
    return fields


def _span_ids() -> dict[str, str]:
    from opentelemetry import trace

    ids = trace.get_current_span().get_span_context()
    if not ids.is_valid:
        return {}
    return {"trace_id": format(ids.trace_id, "032x"), "span_id": format(ids.span_id, "016x")}


class LineHandler(logging.Handler):
    """Writes each record to a descriptor in one write of at most ATOMIC_WRITE_BYTES, so
    the processes sharing a pipe never cut into each other's lines. A longer record (a long
    traceback) is written as several, each a piece of its message and traceback, in the
    record's level, logger and request."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record = _without_header_values(record)  # the pieces are cut from its message too
            line = self._encoded(record)
            if len(line) > ATOMIC_WRITE_BYTES:
                for piece in _pieces(record):
                    self._write(self._encoded(piece))
            else:
                self._write(line)
        except Exception:
            self.handleError(record)

    def _encoded(self, record: logging.LogRecord) -> bytes:
        return (self.format(record) + "\n").encode("utf-8", "backslashreplace")

    def _write(self, data: bytes) -> None:
        view = memoryview(data)  # handle() holds the lock: threads' lines stay whole too
        while view:
            view = view[os.write(self.fd, view) :]


def _pieces(record: logging.LogRecord) -> list[logging.LogRecord]:
    """record as records whose messages are the pieces of its message and traceback (each
    costs at most stray_lines.MAX_RECORD_COST in JSON, the fields around it a few hundred)."""
    text = record.getMessage()
    if record.exc_info or record.exc_text:
        text += "\n" + (record.exc_text or _TRACEBACKS.formatException(record.exc_info))  # type: ignore[arg-type]
    if record.stack_info:
        text += "\n" + record.stack_info
    pieces = []
    for piece in stray_lines.cut(text):
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = piece, None
        copy.exc_info, copy.exc_text, copy.stack_info = None, None, None
        pieces.append(copy)
    return pieces


_TRACEBACKS = logging.Formatter()
_formatter: LineFormatter | None = None
_state: LogState | None = None
_output_fd: int | None = None


def configure(process: str, state: LogState, output_fd: int | None = None) -> None:
    """This process's logging: one handler on standard error (or on output_fd, a descriptor
    of it, where descriptor 2 is relayed), in state's level and format."""
    global _formatter, _output_fd
    _formatter = LineFormatter(process, state.format)
    _output_fd = output_fd
    handler = LineHandler(2 if output_fd is None else output_fd)
    handler.setFormatter(_formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    # Python's warnings (a library's RuntimeWarning, a DeprecationWarning) through logging
    # too, in the same format: printed as they are, they broke JSON's one object per line.
    logging.captureWarnings(True)
    apply(state)


def output_fd() -> int | None:
    """Where this process's log records go when that is not descriptor 2 (its gateway writes
    its lines there too); None: descriptor 2."""
    return _output_fd


def apply(state: LogState) -> None:
    """Switch this process to state's level and format."""
    global _state
    _state = state
    logging.getLogger().setLevel(level_number(state.level))
    if _formatter is not None:
        _formatter.use(state.format)


def change_to(state: LogState, why: str) -> None:
    """apply(state), saying so where it shows: before a change that hides INFO lines, after
    one that shows them."""
    said = f"log settings {why}: level {state.level}, format {state.format}"
    if level_number(state.level) > logging.INFO:
        log.info("%s", said)
        apply(state)
    else:
        apply(state)
        log.info("%s", said)


def current() -> LogState:
    """The level and format this process logs with now."""
    if _state is not None:
        return _state
    return LogState(logging.getLevelName(logging.getLogger().getEffectiveLevel()), "text")


class LogSettingsFile:
    """The level and format of every process, in the run directory: written whole (a new
    file renamed over the old, so a reader never sees half of one), read when it changed."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / SETTINGS_FILE
        self._lock_path = run_dir / (SETTINGS_FILE + ".lock")
        self._seen: tuple[int, int, int] | None = None

    def read(self) -> LogState | None:
        try:
            return LogState.from_json(self.path.read_bytes())
        except OSError:
            return None

    def write(self, state: LogState) -> None:
        temporary = self.path.with_name(f".{SETTINGS_FILE}.{os.getpid()}")
        temporary.write_bytes(state.to_json())
        os.replace(temporary, self.path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held around a read-modify-write, so two front ends changing different settings at
        once both take effect."""
        with self._lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def changed(self) -> LogState | None:
        """The file's state when it changed since the last call (the first call: when there
        is one); else None."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        signature = (info.st_ino, info.st_mtime_ns, info.st_size)
        if signature == self._seen:
            return None
        self._seen = signature
        return self.read()


def _followed(state: LogState) -> None:
    change_to(state, "changed")


async def follow(
    settings_file: LogSettingsFile,
    on_change: Callable[[LogState], None] = _followed,
    interval_s: float = FOLLOW_INTERVAL_S,
) -> None:
    """Apply the settings file's state whenever it changes, until cancelled."""
    while True:
        state = settings_file.changed()
        if state is not None and state != current():
            on_change(state)
        await asyncio.sleep(interval_s)
