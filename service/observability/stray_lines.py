"""Lines a process writes to standard error outside logging (gRPC core, ONNX Runtime, Python's
own last words), read back as log records: which logger, at what level, saying what.

gRPC core writes absl's layout, `E1206 17:49:28.729614   25002 call.cc:361] message`; ONNX
Runtime its own, `2026-12-06 17:49:28.729 [W:onnxruntime:Default, file.cc:12 Fn] message`.
Anything else (a traceback, a fatal error) is an error: nothing writes there when all is
well.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

GRPC_CORE = "grpc.core"
ONNX_RUNTIME = "onnxruntime"
STDERR = "stderr"

_ABSL = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([^\]\s]+)\] ?(.*)$")
_ORT = re.compile(
    rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[([VIWEF]):onnxruntime:[^,\]]*, ?([^\]]*)\] ?(.*)$"
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
    """gRPC core's or ONNX Runtime's line as a record (where it came from after the
    message); None for a line in neither layout."""
    for layout, logger in ((_ABSL, GRPC_CORE), (_ORT, ONNX_RUNTIME)):
        found = layout.match(line)
        if found is not None:
            level, source, message = found.groups()
            return StrayRecord(logger, _LEVEL_OF[level], f"{_text(message)} ({_text(source)})")
    return None


def records(lines: list[bytes]) -> list[StrayRecord]:
    """lines as records: each recognised line one, each run of other lines (a traceback)
    one ERROR record of those lines."""
    found: list[StrayRecord] = []
    other: list[str] = []

    def end_other() -> None:
        if other:
            found.append(StrayRecord(STDERR, logging.ERROR, "\n".join(other)))
            other.clear()

    for line in lines:
        line = line.rstrip(b"\r")
        if not line.strip():
            continue
        record = parse(line)
        if record is None:
            other.append(_text(line))
        else:
            end_other()
            found.append(record)
    end_other()
    return found
