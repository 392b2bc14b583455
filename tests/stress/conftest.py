"""Bounded versions of the reliability scenarios (python -m bench.stress runs the long ones).

Every test here is marked `stress` and hands its figures to `figures`; they are printed in
pytest's terminal summary, so they show in CI's output with or without -s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bench.stress.common import format_figures

FIGURES = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stress: bounded reliability scenario (overload, drain, faults, soak, fuzz)"
    )
    config.stash[FIGURES] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/stress/" in item.nodeid:
            item.add_marker(pytest.mark.stress)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[dict[str, Any]], None]:
    """Record a scenario's figures under the test's name for the terminal summary."""

    def record(values: dict[str, Any]) -> None:
        request.config.stash[FIGURES].append(format_figures(request.node.nodeid, values))

    return record


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    recorded = config.stash.get(FIGURES, [])
    if recorded:
        terminalreporter.section("reliability figures (bounded CI versions)")
        for text in recorded:
            terminalreporter.write_line(text)
