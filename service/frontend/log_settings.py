"""Triton's logging extension (GET/POST v2/logging, gRPC LogSettings): the level and format of
every process, read and changed while the server runs.

Triton's settings are switches per level; here a level is a threshold (a record is logged
when it is at least as severe), so they map onto one:

    log_verbose_level > 0 -> DEBUG       log_info    -> INFO
    log_warning           -> WARNING     log_error   -> ERROR       all off -> OFF

A setting turned on turns on the levels above it; one turned off turns off the levels below
it (log_warning false leaves ERROR). A request that turns a level on and one above it off
is refused. log_format takes text or json (Triton's own two formats, default and ISO8601,
are text lines: both mean text); log_file only "" (logs go to standard error).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.errors import InvalidInput
from service.generated.inference import grpc_service_pb2 as v2
from service.observability import logs
from service.observability.logs import LogSettingsFile, LogState

# Triton's switches, each with the rank of the level it stands for.
RANK_OF_SETTING = {"log_error": 0, "log_warning": 1, "log_info": 2, "log_verbose_level": 3}
LEVEL_OF_RANK = {-1: "OFF", 0: "ERROR", 1: "WARNING", 2: "INFO", 3: "DEBUG"}
RANK_OF_LEVEL = {level: rank for rank, level in LEVEL_OF_RANK.items()}
FORMAT_OF = {"text": "text", "json": "json", "default": "text", "ISO8601": "text"}
SETTINGS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
Value = bool | int | str


def triton_view(state: LogState) -> dict[str, Value]:
    """state as Triton's log settings (every one of them, as Triton answers)."""
    rank = RANK_OF_LEVEL[state.level]
    return {
        "log_file": "",
        "log_info": rank >= 2,
        "log_warning": rank >= 1,
        "log_error": rank >= 0,
        "log_verbose_level": 1 if rank >= 3 else 0,
        "log_format": state.format,
    }


def updated(state: LogState, changes: Mapping[str, object]) -> LogState:
    """state with Triton's settings in changes applied; InvalidInput says what is wrong."""
    unknown = [name for name in changes if name not in SETTINGS]
    if unknown:
        raise InvalidInput(
            f"unknown log setting {_shown(unknown[0])}; expected some of {', '.join(SETTINGS)}"
        )
    rank, format_name = RANK_OF_LEVEL[state.level], state.format
    on = [RANK_OF_SETTING[name] for name in RANK_OF_SETTING if _switch(changes, name) is True]
    off = [RANK_OF_SETTING[name] for name in RANK_OF_SETTING if _switch(changes, name) is False]
    if on and off and min(off) <= max(on):
        raise InvalidInput(
            "a log level is turned on while a more severe one is turned off; levels are "
            "thresholds here (log_error < log_warning < log_info < log_verbose_level): turning "
            "one off turns off those below it"
        )
    if on:
        rank = max(rank, max(on))
    if off:
        rank = min(rank, min(off) - 1)
    if "log_format" in changes:
        asked = changes["log_format"]
        if not isinstance(asked, str) or asked not in FORMAT_OF:
            raise InvalidInput(
                f"log_format is {_shown(asked)}; expected text or json (Triton's default "
                "and ISO8601 mean text)"
            )
        format_name = FORMAT_OF[asked]
    if "log_file" in changes and changes["log_file"] != "":
        raise InvalidInput(
            'log_file can only be "": this server logs to standard error (its container log)'
        )
    return LogState(LEVEL_OF_RANK[rank], format_name)


def _switch(changes: Mapping[str, object], name: str) -> bool | None:
    """Whether changes turn name's level on (True) or off (False); None: not named."""
    if name not in changes:
        return None
    value = changes[name]
    if name == "log_verbose_level":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"log_verbose_level is {_shown(value)}; expected an integer >= 0")
        return value > 0
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} is {_shown(value)}; expected true or false")
    return value


def _shown(value: object) -> str:
    """A client's value for a message: short, whatever it is."""
    return repr(value)[:64]


def from_proto(request: v2.LogSettingsRequest) -> dict[str, Value]:
    """A LogSettings request's settings as plain values."""
    changes: dict[str, Value] = {}
    for name, setting in request.settings.items():
        choice = setting.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidInput(f"log setting {_shown(name)} has no value")
        changes[name] = getattr(setting, choice)
    return changes


def to_proto(view: Mapping[str, Value]) -> v2.LogSettingsResponse:
    response = v2.LogSettingsResponse()
    for name, value in view.items():
        setting = response.settings[name]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = value
    return response


class LogControl:
    """The log settings of every process, through the run directory's settings file (each
    process follows it); without a run directory, this process's alone."""

    def __init__(self, run_dir: Path | None) -> None:
        self._file = None if run_dir is None else LogSettingsFile(run_dir)

    def _state(self) -> LogState:
        return (self._file.read() if self._file is not None else None) or logs.current()

    def view(self) -> dict[str, Value]:
        return triton_view(self._state())

    def update(self, changes: Mapping[str, Any], who: str) -> dict[str, Value]:
        """Apply changes everywhere; the settings in force after them."""
        if self._file is None:
            state = updated(self._state(), changes)
        else:
            with self._file.locked():  # another front end may be changing them too
                state = updated(self._state(), changes)
                self._file.write(state)
        logs.change_to(state, f"set by {who}")
        return triton_view(state)
