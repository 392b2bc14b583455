"""Lines a process writes to standard error outside logging (gRPC core, ONNX Runtime, Python's
own last words), read back as log records: which logger, at what level, saying what.

gRPC core writes absl's layout, `E1206 17:49:28.729614   25002 call.cc:361] message`; ONNX
Runtime its own, `2026-12-06 17:49:28.729 [W:onnxruntime:, graph.cc:12 Fn] message`, in
terminal colours. Anything else (a traceback, a fatal error) is an error: nothing writes
there when all is well.

A record's message costs at most MAX_RECORD_COST characters written as JSON (ASCII only,
as the log lines are: `é` is `\u00e9`, six): a longer line is logged in pieces, each a record
of the line's logger and level. A log line then stays short enough for one write to a pipe
to carry it whole (a container's standard error is one), so no other process's line can
land inside it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

GRPC_CORE = "grpc.core"
ONNX_RUNTIME = "onnxruntime"
STDERR = "stderr"
MAX_RECORD_COST = 2048

# Terminal control sequences (colours, cursor moves): ONNX Runtime colours its lines.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# absl's time is `MMDD HH:MM:SS.micros`, or `0000 00:00:SECONDS.micros` before it is set up.
_ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ ([^\]\s]+)\] ?(.*)$", re.DOTALL)
_ORT = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[([VIWEF]):onnxruntime:[^,\]]*, ?([^\]]*)\] ?(.*)$",
    re.DOTALL,
)
_LEVEL_OF = {
    "V": logging.DEBUG,
    "I": logging.INFO,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}


@dataclass(frozen=True)
class StrayRecord:
    logger: str
    level: int
    message: str


def _text(raw: bytes) -> str:
    """A line as text, its control sequences taken out (bytes that are not UTF-8 shown)."""
    return _CONTROL.sub("", raw.decode("utf-8", errors="backslashreplace")).rstrip("\r")


def json_cost(text: str) -> int:
    """What text costs written as a JSON string (without its quotes), as log lines are."""
    return len(json.dumps(text)) - 2


def parse(line: bytes) -> StrayRecord | None:
    """gRPC core's or ONNX Runtime's line as one record, where it came from after the
    message; None for a line in neither layout."""
    return _parsed(_text(line))


def _parsed(text: str) -> StrayRecord | None:
    for layout, logger in ((_ABSL, GRPC_CORE), (_ORT, ONNX_RUNTIME)):
        found = layout.match(text)
        if found is not None:
            level, source, message = found.groups()
            return StrayRecord(logger, _LEVEL_OF[level], f"{message} ({source})")
    return None


def records(lines: list[bytes]) -> list[StrayRecord]:
    """lines as records: each recognised line one, each run of other lines (a traceback read
    at once) one ERROR record of those lines; none over MAX_RECORD_COST."""
    found: list[StrayRecord] = []
    run: list[str] = []
    run_cost = 0

    def end_run() -> None:
        nonlocal run_cost
        if run:
            found.append(StrayRecord(STDERR, logging.ERROR, "\n".join(run)))
            run.clear()
            run_cost = 0

    for line in lines:
        text = _text(line)
        if not text.strip():
            continue
        record = _parsed(text)
        if record is not None:
            end_run()
            found.extend(
                StrayRecord(record.logger, record.level, piece) for piece in cut(record.message)
            )
            continue
        for piece in cut(text):
            cost = json_cost(piece) + 2  # and the newline joining it to the run
            if run and run_cost + cost > MAX_RECORD_COST:
                end_run()
            run.append(piece)
            run_cost += cost
    end_run()
    return found


def cut(text: str) -> list[str]:
    """text in pieces that cost at most MAX_RECORD_COST each in JSON."""
    pieces = []
    start = 0
    while start < len(text):
        end = min(len(text), start + MAX_RECORD_COST)  # a character costs 1 or more
        cost = json_cost(text[start:end])
        while cost > MAX_RECORD_COST:
            end = start + max(1, (end - start) * MAX_RECORD_COST // cost)
            cost = json_cost(text[start:end])
        pieces.append(text[start:end])
        start = end
    return pieces or [text]
