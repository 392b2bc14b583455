"""Lines a process writes to standard error outside logging (gRPC core, ONNX Runtime, Python's
own last words), read back as log records: which logger, at what level, saying what.

gRPC core writes absl's layout, `E1206 17:49:28.729614   25002 call.cc:361] message`; ONNX
Runtime its own, `2026-12-06 17:49:28.729 [W:onnxruntime:, graph.cc:12 Fn] message`, in
terminal colours. Anything else (a traceback, a fatal error) is an error: nothing writes
there when all is well.

A record holds at most MAX_RECORD_BYTES of text: a longer line is logged in pieces, each a
record of the line's logger and level. A log line of plain text then stays short enough for
one write to a pipe to carry it whole (a container's standard error is one), so no other
process's line can land inside it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

GRPC_CORE = "grpc.core"
ONNX_RUNTIME = "onnxruntime"
STDERR = "stderr"
MAX_RECORD_BYTES = 2048

_COLOUR = re.compile(rb"\x1b\[[0-9;]*m")
# absl's time is `MMDD HH:MM:SS.micros`, or `0000 00:00:SECONDS.micros` before it is set up.
_ABSL = re.compile(rb"^([IWEF])\d{4} [\d:.]+ +\d+ ([^\]\s]+)\] ?(.*)$", re.DOTALL)
_ORT = re.compile(
    rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[([VIWEF]):onnxruntime:[^,\]]*, ?([^\]]*)\] ?(.*)$",
    re.DOTALL,
)
_LEVEL_OF = {
    b"V": logging.DEBUG,
    b"I": logging.INFO,
    b"W": logging.WARNING,
    b"E": logging.ERROR,
    b"F": logging.CRITICAL,
}


@dataclass(frozen=True)
class StrayRecord:
    logger: str
    level: int
    message: str


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="backslashreplace")


def parse(line: bytes) -> StrayRecord | None:
    """gRPC core's or ONNX Runtime's line (colours taken out) as one record, where it came
    from after the message; None for a line in neither layout."""
    line = _COLOUR.sub(b"", line)
    for layout, logger in ((_ABSL, GRPC_CORE), (_ORT, ONNX_RUNTIME)):
        found = layout.match(line)
        if found is not None:
            level, source, message = found.groups()
            return StrayRecord(logger, _LEVEL_OF[level], f"{_text(message)} ({_text(source)})")
    return None


def records(lines: list[bytes]) -> list[StrayRecord]:
    """lines as records: each recognised line one, each run of other lines (a traceback read
    at once) one ERROR record of those lines; none over MAX_RECORD_BYTES."""
    found: list[StrayRecord] = []
    run: list[bytes] = []

    def end_run() -> None:
        if run:
            found.append(StrayRecord(STDERR, logging.ERROR, _text(b"\n".join(run))))
            run.clear()

    for line in lines:
        line = _COLOUR.sub(b"", line).rstrip(b"\r")
        if not line.strip():
            continue
        record = parse(line)
        if record is not None:
            end_run()
            found.extend(_pieces(record))
            continue
        for piece in _cut(line):
            if run and sum(len(part) + 1 for part in run) + len(piece) > MAX_RECORD_BYTES:
                end_run()
            run.append(piece)
    end_run()
    return found


def _pieces(record: StrayRecord) -> list[StrayRecord]:
    raw = record.message.encode()
    return [StrayRecord(record.logger, record.level, _text(piece)) for piece in _cut(raw)]


def _cut(raw: bytes) -> list[bytes]:
    """raw in pieces of at most MAX_RECORD_BYTES, never inside a UTF-8 character."""
    pieces = []
    while len(raw) > MAX_RECORD_BYTES:
        end = MAX_RECORD_BYTES
        while end > MAX_RECORD_BYTES - 4 and raw[end] & 0xC0 == 0x80:  # a continuation byte
            end -= 1
        pieces.append(raw[:end])
        raw = raw[end:]
    pieces.append(raw)
    return pieces
