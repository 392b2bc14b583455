"""The drain's one start: the supervisor's signal, read back by every process."""

from __future__ import annotations

import time
from pathlib import Path

from service import drain_clock


def test_a_child_times_its_drain_from_the_supervisors_signal(tmp_path: Path) -> None:
    assert drain_clock.record(tmp_path) is None
    for late_s in [0.5, 3600.0]:  # a child's loop busy that long (an hour: no time left)
        handled_at = time.monotonic() + late_s
        started = drain_clock.started(tmp_path, handled_at)
        assert late_s - 0.01 <= handled_at - started <= late_s + 0.1


def test_without_a_plausible_record_a_child_times_it_from_its_own_handling(
    tmp_path: Path,
) -> None:
    handled_at = time.monotonic()
    assert drain_clock.started(tmp_path, handled_at) == handled_at
    for content in [
        "soon",
        "nan",
        "inf",
        "-inf",
        repr(time.time() - 2 * 86400),
        repr(time.time() + 60),
    ]:
        drain_clock.path(tmp_path).write_text(content)
        assert drain_clock.started(tmp_path, handled_at) == handled_at, content


def test_a_record_that_cannot_be_written_says_why(tmp_path: Path) -> None:
    assert isinstance(drain_clock.record(tmp_path / "gone"), OSError)
