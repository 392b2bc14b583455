"""One strict version rule for folders on disk and versions in requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.repository import existing_versions, next_version
from service.worker.engine.repository import discover, parse_version

ODD_NAMES = ["²", "１", "١", "01", "0", "9" * 40, "1 ", "-1", "+1", "1e3", ""]


@pytest.mark.parametrize("text", ODD_NAMES)
def test_odd_versions_are_not_versions(text: str) -> None:
    assert parse_version(text) is None


def test_plain_versions_parse() -> None:
    assert [parse_version(t) for t in ("1", "42", "9" * 18)] == [1, 42, 10**18 - 1]


def _repository(root: Path) -> Path:
    for name in ["3", *ODD_NAMES[:-1]]:
        folder = root / "m" / name
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(b"")
    return root


def test_export_skips_odd_version_folders(tmp_path: Path) -> None:
    """They used to crash `python -m export` (int("²")) or count as version 1 ("１")."""
    _repository(tmp_path)
    assert existing_versions(tmp_path / "m") == [3]
    assert next_version(tmp_path / "m") == 4


def test_server_skips_odd_version_folders(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """They used to stop the server from starting; now each is logged and skipped."""
    found = discover(_repository(tmp_path))
    assert [(files.name, files.version) for files in found] == [("m", 3)]
    assert caplog.text.count("a version folder's name must be") == len(ODD_NAMES) - 1
