"""The drain's one start: the supervisor's signal, read back by every process."""

from __future__ import annotations

import time
from pathlib import Path

from service import drain_clock


def test_a_child_times_its_drain_from_the_supervisors_signal(tmp_path: Path) -> None:
    drain_clock.record(tmp_path)
    handled_at = time.monotonic() + 0.5  # a child's loop busy that long before it handles it
    started = drain_clock.started(tmp_path, handled_at, grace_period_s=30)
    assert 0.49 <= handled_at - started <= 0.6


def test_without_a_plausible_record_a_child_times_it_from_its_own_handling(
    tmp_path: Path,
) -> None:
    handled_at = time.monotonic()
    assert drain_clock.started(tmp_path, handled_at, grace_period_s=30) == handled_at
    for content in ["soon", repr(time.time() - 60), repr(time.time() + 60)]:
        drain_clock.path(tmp_path).write_text(content)
        assert drain_clock.started(tmp_path, handled_at, grace_period_s=30) == handled_at
