"""python -m export's own checks of its arguments: each refused with a clear error and exit
code 2 before anything is written, where a name could write outside --out or a zero was
taken for the default."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.__main__ import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--name", "../evil"], "must be a single folder name"),
        (["--name", "a/b"], "must be a single folder name"),
        (["--name", ".."], "must be a single folder name"),
        (["--name", ""], "is empty"),
        (["--name", ".hidden"], "starts with a dot: the server skips such folders"),
        (["--name", "two words"], "must not hold spaces or control characters"),
        (["--hf-model", "x", "--embed-dim", "0"], "reads d and h from its config.json"),
        (["--hf-layer", "1"], "--hf-layer needs --hf-model"),
        (["--tolerance", "-1"], "--tolerance must be a number > 0, got -1.0"),
        (["--tolerance", "nan"], "--tolerance must be a number > 0, got nan"),
        (["--version", "0"], "--version must be 1.."),
    ],
    ids=[
        "parent",
        "nested",
        "dotdot",
        "empty",
        "hidden",
        "space",
        "hf with d 0",
        "hf layer alone",
        "negative tolerance",
        "nan tolerance",
        "version 0",
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    out = tmp_path / "repo" / "models"
    assert main([*argv, "--out", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("flag", ["--embed-dim", "--num-heads"])
def test_zero_dimensions_are_refused_not_taken_for_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    assert main([flag, "0", "--out", str(tmp_path)]) == 1
    assert "must be a positive integer, got 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_an_out_that_is_a_file_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert main(["--name", "t", "--embed-dim", "16", "--num-heads", "2", "--out", str(taken)]) == 1
    assert "Not a directory" in capsys.readouterr().err
