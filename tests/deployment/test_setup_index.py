"""Where torch comes from: scripts/torch_index.py decides, in a few seconds, whether PyTorch's
CPU index is used, and make setup, scripts/build-image-offline.sh and the Dockerfile follow it.

Loopback stands in for the index: one that answers (a PEP 503 page for torch), one without a
torch page, one that refuses connections and one that accepts and never answers. The Makefile
and the offline script run for real with stub pip, python -m venv, go and container engine, so
what they would install is read from what they asked for; nothing is downloaded.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.harness import free_port, silent_listener
from scripts import torch_index

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/torch_index.py"
# A probe's timeout here, and how long past it the answer may come.
TIMEOUT_S = 1.0
SLACK_S = 1.5


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _serve(folder: Path) -> Iterator[str]:
    handler = partial(_Quiet, directory=str(folder))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/simple"
        finally:
            server.shutdown()
            thread.join()


@pytest.fixture(scope="module")
def answering_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PEP 503 index on loopback with a page for torch (linking a wheel it does not hold)."""
    root = tmp_path_factory.mktemp("index")
    page = root / "simple/torch/index.html"
    page.parent.mkdir(parents=True)
    page.write_text('<a href="torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl">t</a>\n')
    yield from _serve(root)


@pytest.fixture(scope="module")
def index_without_torch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("empty-index")
    (root / "simple").mkdir()
    yield from _serve(root)


@pytest.fixture
def refusing_index() -> str:
    return f"http://127.0.0.1:{free_port()}/simple"  # closed: connections are refused


@pytest.fixture
def silent_index() -> Iterator[str]:
    """Accepts connections (the kernel's backlog) and never answers."""
    with silent_listener() as port:
        yield f"http://127.0.0.1:{port}/simple"


def _probe(index: str) -> tuple[torch_index.Decision, float]:
    start = time.monotonic()
    decision = torch_index.probe(index, TIMEOUT_S)
    return decision, time.monotonic() - start


def test_an_index_whose_torch_page_answers_is_used(answering_index: str) -> None:
    decision, _ = _probe(answering_index + "/")
    assert decision == torch_index.Decision(answering_index)


def test_an_index_without_a_torch_page_is_skipped(index_without_torch: str) -> None:
    decision, _ = _probe(index_without_torch)
    assert decision.index == ""
    assert "HTTP 404" in decision.reason


def test_a_refused_connection_is_skipped_at_once(refusing_index: str) -> None:
    decision, elapsed = _probe(refusing_index)
    assert decision.index == ""
    assert "refused" in decision.reason.lower()
    assert elapsed < TIMEOUT_S


def test_an_index_that_never_answers_is_skipped_when_the_time_is_up(silent_index: str) -> None:
    decision, elapsed = _probe(silent_index)
    assert decision.index == ""
    assert "no answer within 1 s" in decision.reason
    assert elapsed < TIMEOUT_S + SLACK_S


def test_file_indexes_and_other_schemes(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    assert torch_index.probe(tmp_path.as_uri()).index == tmp_path.as_uri()
    assert torch_index.probe((tmp_path / "none").as_uri()).index == ""
    assert "not an http(s) or file URL" in torch_index.probe("ftp://example/simple").reason


def _cli(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done, time.monotonic() - start


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != torch_index.ENV}
    return {**env, **extra}


def test_the_command_prints_the_index_or_one_line_why_not(
    answering_index: str, silent_index: str
) -> None:
    done, _ = _cli(env=_env(TORCH_INDEX=answering_index))
    assert (done.stdout, done.stderr) == (answering_index + "\n", "")
    # The default timeout bounds the wait on an index that never answers.
    assert torch_index.TIMEOUT_S <= 5
    done, elapsed = _cli(silent_index, "--timeout-s", str(TIMEOUT_S), env=_env())
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert f"torch index {silent_index} skipped (no answer within 1 s)" in done.stderr
    assert "TORCH_INDEX=URL" in done.stderr
    assert elapsed < TIMEOUT_S + SLACK_S + 2  # + the interpreter's start


def test_an_empty_torch_index_means_none_and_says_nothing() -> None:
    done, _ = _cli(env=_env(TORCH_INDEX=""))
    assert (done.stdout, done.stderr) == ("", "")


def test_pytorchs_cpu_index_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def probe(index: str, timeout_s: float) -> torch_index.Decision:
        asked.append(index)
        return torch_index.Decision("", "not asked")

    monkeypatch.delenv(torch_index.ENV, raising=False)
    monkeypatch.setattr(torch_index, "probe", probe)
    torch_index.main([])
    assert asked == ["https://download.pytorch.org/whl/cpu"]
    # The Dockerfile's build argument has the same default.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG TORCH_INDEX={torch_index.DEFAULT}\n" in dockerfile


def test_torch_is_pinned_so_pypi_and_the_cpu_index_both_resolve() -> None:
    """The pin has no local label (PyPI has no +cpu build); the server never pulls torch."""
    (pin,) = re.findall(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert "+" not in pin
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert f"torch=={pin}" in extras["export"]
    for requirement in project["dependencies"] + extras["server"] + extras["gpu"]:
        assert not requirement.startswith("torch"), requirement


# --- make setup and the offline build script, with stubs ----------------------------------

_LOG_STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
"""
# python3 -m venv .venv: a "virtualenv" whose pip and go only log, and whose python is real.
_VENV_STUB = """#!/bin/sh
[ "$1 $2" = "-m venv" ] || exec "{python}" "$@"
mkdir -p "$3/bin"
ln -sf "{python}" "$3/bin/python"
printf '#!/bin/sh\\necho "pip $*" >> "{log}"\\n' > "$3/bin/pip"
printf '#!/bin/sh\\nwhile [ "$1" != -o ]; do shift; done; touch "$2"\\n' > "$3/bin/go"
chmod +x "$3/bin/pip" "$3/bin/go"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _checkout(tmp_path: Path) -> Path:
    """The files make setup and the offline script read, copied; no virtualenv."""
    tree = tmp_path / "checkout"
    for name in (
        "Makefile",
        "pyproject.toml",
        "constraints.txt",
        "constraints-gpu.txt",
        "scripts/torch_index.py",
        "scripts/build-image-offline.sh",
        "service/gateway/go.mod",
    ):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes((ROOT / name).read_bytes())
    (tree / "scripts/build-image-offline.sh").chmod(0o755)
    return tree


def _make_setup(tmp_path: Path, index: str) -> tuple[list[str], str, float]:
    """make setup with TORCH_INDEX=index in a copy: the pip commands, stderr and seconds."""
    tree, log = _checkout(tmp_path), tmp_path / "log"
    stub = _executable(tmp_path / "python3", _VENV_STUB.format(python=sys.executable, log=log))
    start = time.monotonic()
    done = subprocess.run(
        ["make", "--no-print-directory", "setup", f"PYTHON={stub}", f"TORCH_INDEX={index}"],
        cwd=tree,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tree / ".venv/.installed").exists()
    assert (tree / ".venv/bin/attention-gateway").exists()
    return log.read_text().splitlines(), done.stderr, elapsed


def test_make_setup_takes_torch_from_an_index_that_answers(
    tmp_path: Path, answering_index: str
) -> None:
    pip, stderr, _ = _make_setup(tmp_path, answering_index)
    assert pip == [
        "pip install --quiet --upgrade pip",
        f"pip install --quiet -c constraints.txt --extra-index-url {answering_index} torch",
        "pip install --quiet -c constraints.txt -e .[server,export,plot,docs,dev]",
    ]
    assert "skipped" not in stderr


def test_make_setup_goes_on_without_an_index_that_never_answers(
    tmp_path: Path, silent_index: str
) -> None:
    pip, stderr, elapsed = _make_setup(tmp_path, silent_index)
    assert pip[1] == "pip install --quiet -c constraints.txt torch"
    assert f"torch index {silent_index} skipped (no answer within" in stderr
    assert elapsed < torch_index.TIMEOUT_S + 10


def _offline_build(tmp_path: Path, **env: str) -> tuple[str, str]:
    """scripts/build-image-offline.sh with an echoing pip and a stub engine whose base image
    exists: (what pip and the engine were asked, stderr)."""
    tree, log = _checkout(tmp_path), tmp_path / "log"
    pip = _executable(tmp_path / "pip", _LOG_STUB.format(log=log))
    engine = _executable(tmp_path / "engine", _LOG_STUB.format(log=log))
    done = subprocess.run(
        ["scripts/build-image-offline.sh"],
        cwd=tree,
        env=_env(PIP=str(pip), ENGINE=str(engine), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return log.read_text(), done.stderr


def test_the_offline_wheelhouse_asks_an_index_that_answers(
    tmp_path: Path, answering_index: str
) -> None:
    asked, stderr = _offline_build(tmp_path, TORCH_INDEX=answering_index)
    (download,) = [line for line in asked.splitlines() if line.startswith("pip download")]
    assert f" --extra-index-url {answering_index} " in download
    assert download.endswith(" torch onnx onnxscript setuptools>=68")
    # The image build installs from the wheelhouse only: no index, no probe inside.
    (build,) = [line for line in asked.splitlines() if line.startswith("engine build")]
    assert "--build-arg PIP_NO_INDEX=1" in build
    assert "--build-arg TORCH_INDEX= " in build
    assert stderr == ""


def test_the_offline_wheelhouse_goes_on_without_an_unreachable_index(
    tmp_path: Path, refusing_index: str
) -> None:
    start = time.monotonic()
    asked, stderr = _offline_build(tmp_path, TORCH_INDEX=refusing_index)
    assert time.monotonic() - start < 10
    (download,) = [line for line in asked.splitlines() if line.startswith("pip download")]
    assert "--extra-index-url" not in download
    assert f"torch index {refusing_index} skipped" in stderr
