"""The client installs alone: `pip install -c constraints.txt '.[client]'` into a fresh
virtualenv (not editable) gives a working `python -m service.client` and AttentionClient, and
pulls neither onnxruntime nor torch. The installed client then calls a real server.

Needs the package index (or pip's cache), as `make setup` does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
# What `pip install .` reads: the project's metadata and its packages.
SOURCES = ["pyproject.toml", "README.md", "constraints.txt", "service", "export"]
CHECK = """
import importlib.util, pathlib, sys
from service.client import AsyncAttentionClient, AttentionClient, tls_options
import service
assert "site-packages" in pathlib.Path(service.__file__).parts, service.__file__
heavy = [name for name in ("onnxruntime", "torch", "prometheus_client") if importlib.util.find_spec(name)]
assert not heavy, f"the client install pulled {heavy}"
print("client-only install ok", sys.version.split()[0])
"""


def _run(*args: str | Path, cwd: Path, timeout_s: float) -> str:
    done = subprocess.run(
        [str(arg) for arg in args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{args}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="session")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Python of a fresh virtualenv with the client extra installed from a copy of the
    sources (not editable), checked to hold the client alone; installed once a session (both gateway modes use it)."""
    tmp_path = tmp_path_factory.mktemp("client-install")
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    venv = tmp_path / "venv"
    started = time.monotonic()
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, timeout_s=120)
    python = venv / "bin" / "python"
    _run(
        python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "-c",
        "constraints.txt",
        ".[client]",
        cwd=source,
        timeout_s=300,
    )
    print(f"client-only virtualenv and install: {time.monotonic() - started:.1f}s")
    elsewhere = tmp_path / "elsewhere"  # not the source tree: only the installed package counts
    elsewhere.mkdir()
    assert "client-only install ok" in _run(python, "-c", CHECK, cwd=elsewhere, timeout_s=60)
    assert "usage: python -m service.client" in _run(
        python, "-m", "service.client", "--help", cwd=elsewhere, timeout_s=60
    )
    assert "usage: python -m service.healthcheck" in _run(
        python, "-m", "service.healthcheck", "--help", cwd=elsewhere, timeout_s=60
    )
    return python


@pytest.mark.timeout(420)
def test_the_client_extra_installs_and_works_without_the_server(
    client_python: Path, tmp_path: Path, server: ServerProcess
) -> None:
    answer = _run(
        client_python,
        "-m",
        "service.client",
        "--target",
        server.target,
        "--seq",
        "4",
        "--weights",
        cwd=tmp_path,
        timeout_s=60,
    )
    assert "attention_weights [" in answer, answer
