"""Settings precedence and validation; generated protobuf code matches proto/."""

from __future__ import annotations

import filecmp
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.settings import load_settings

REPO = Path(__file__).resolve().parent.parent


def test_flags_beat_environment_beat_defaults() -> None:
    assert load_settings([], {}).grpc_port == 8001
    assert load_settings([], {}).metrics_port == 8002
    env = {"ATTENTION_GRPC_PORT": "9001", "ATTENTION_MAX_QUEUE_DELAY_MS": "7.5"}
    from_env = load_settings([], env)
    assert (from_env.grpc_port, from_env.max_queue_delay_ms) == (9001, 7.5)
    assert load_settings(["--grpc-port", "9100"], env).grpc_port == 9100


def test_padding_ratio_is_auto_by_default_and_a_number_when_given() -> None:
    default = load_settings([], {})
    assert default.max_padding_ratio == "auto"
    assert default.padding_ratio(auto=0.05) == 0.05  # the worker's value for its device
    given = load_settings(["--max-padding-ratio", "0.3"], {})
    assert given.padding_ratio(auto=0.05) == 0.3
    assert load_settings([], {"ATTENTION_MAX_PADDING_RATIO": "0"}).padding_ratio(auto=0.5) == 0


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--max-batch-size", "0"],
            {},
            "--max-batch-size (ATTENTION_MAX_BATCH_SIZE) must be >= 1, got 0",
        ),
        (["--provider", "tpu"], {}, "argument --provider: invalid choice: 'tpu'"),
        ([], {"ATTENTION_PROVIDER": "tpu"}, "--provider (ATTENTION_PROVIDER) must be one of"),
        ([], {"ATTENTION_GRPC_PORT": "eighty"}, "ATTENTION_GRPC_PORT='eighty' is not a valid int"),
        (["--grpc-port", "70000"], {}, "--grpc-port (ATTENTION_GRPC_PORT) must be 0..65535"),
        (
            ["--max-padding-ratio", "1.5"],
            {},
            "--max-padding-ratio (ATTENTION_MAX_PADDING_RATIO) must be auto or a number in 0..1, "
            "got '1.5'",
        ),
        (
            [],
            {"ATTENTION_MAX_PADDING_RATIO": "some"},
            "--max-padding-ratio (ATTENTION_MAX_PADDING_RATIO) must be auto or a number in 0..1, "
            "got 'some'",
        ),
        (
            ["--max-padding-ratio", "nan"],
            {},
            "--max-padding-ratio (ATTENTION_MAX_PADDING_RATIO) must be auto",
        ),
        (
            ["--grpc-gateway-binary", "/nonexistent/attention-gateway"],
            {},
            "--grpc-gateway-binary (ATTENTION_GRPC_GATEWAY_BINARY) must be an executable file "
            "or a command on PATH, or empty",
        ),
        (
            ["--max-undelivered-bytes", "10", "--max-undelivered-bytes-per-connection", "20"],
            {},
            "must be at least 1 and at most --max-undelivered-bytes, got 20",
        ),
    ],
)
def test_bad_settings_are_reported(argv, env, message, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(argv, env)
    assert message in capsys.readouterr().err


def test_the_gateway_binary_may_be_a_command_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the front end runs it. (A check by file alone refused a bare command name.)"""
    gateway = tmp_path / "my-gateway"
    gateway.write_text("#!/bin/sh\n")
    gateway.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert load_settings(["--grpc-gateway-binary", "my-gateway"], {}).grpc_gateway_binary
    assert load_settings(["--grpc-gateway-binary", str(gateway)], {}).grpc_gateway_binary
    off = load_settings(["--grpc-gateway", "off", "--grpc-gateway-binary", "/nope"], {})
    assert off.grpc_gateway_binary == "/nope"  # never run


def test_help_lists_every_flag_and_its_environment_variable() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    for flag in (
        "--host",
        "--grpc-port",
        "--metrics-port",
        "--model-repository",
        "--max-batch-size",
        "--max-queue-delay-ms",
        "--max-queue-size",
        "--max-seq-len",
        "--intra-op-threads",
        "--grace-period-s",
    ):
        assert flag in done.stdout
    assert "ATTENTION_GRPC_PORT" in done.stdout
    assert "defaults < environment < flags" in done.stdout


def test_generated_code_is_current(tmp_path: Path) -> None:
    out = tmp_path / "generated"
    subprocess.run([sys.executable, "proto/generate.py", "--out", str(out)], check=True, cwd=REPO)
    committed = REPO / "service" / "generated"
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert fresh == sorted(
        p.relative_to(committed)
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    stale = [str(p) for p in fresh if not filecmp.cmp(out / p, committed / p, shallow=False)]
    assert not stale, f"run `python proto/generate.py`: {stale} differ from proto/"


def test_serving_side_never_imports_torch() -> None:
    code = (
        "import sys, service.__main__, service.app.supervisor, service.frontend.server, "
        "service.worker.server, service.client;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_makefile_runs_modules_and_scripts_that_exist() -> None:
    makefile = (REPO / "Makefile").read_text()
    modules = re.findall(r"python -m ([\w.]+)", makefile)
    assert {"export", "service", "pytest", "bench"} <= set(modules)
    for module in modules:
        assert importlib.util.find_spec(module) is not None, f"Makefile runs missing {module}"
    for script in re.findall(r"python (\S+\.py)", makefile):
        assert (REPO / script).is_file(), f"Makefile runs missing {script}"
