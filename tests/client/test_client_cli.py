"""The client CLI refuses counts that would crash or hang it, before it connects."""

from __future__ import annotations

import pytest

from service import client


@pytest.mark.parametrize(
    "flags",
    [
        ["--requests", "0"],
        ["--concurrency", "0"],
        ["--seq", "-5"],
        ["--seq", "0"],
        ["--n", "0"],
        ["--requests", "many"],
    ],
)
def test_cli_refuses_counts_below_one(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        client.main(["--target", "127.0.0.1:1", *flags])
    assert exited.value.code == 2  # argparse's usage error, not a crash or a hang
    assert flags[0] in capsys.readouterr().err
