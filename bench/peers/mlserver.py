"""Seldon MLServer as the peer: its own virtualenv (MLServer and tritonclient disagree on
packages), the same ONNX graph through bench/peers/mlserver_ort, the same V2 load generator
and pinning as our server. A few adaptive-batching settings are tried; the report keeps the
best."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness import free_port
from bench.launcher import REPO_ROOT, Service
from bench.report import SEQS
from bench.runner import Runner, log

HERE = Path(__file__).resolve().parent
RUNTIME = HERE / "mlserver_ort"
CONSTRAINTS = HERE / "mlserver-constraints.txt"
VENV = REPO_ROOT / ".bench-venvs" / "mlserver"
PACKAGES = ("mlserver==1.7.1", "uvloop==0.21.0", "onnxruntime==1.31.1")
# (max_batch_size, max_batch_time_s); max_batch_size 0 turns adaptive batching off.
CONFIGS = ((0, 0.0), (8, 0.001), (32, 0.002))


def ensure_venv(venv: Path = VENV) -> Path:
    """Create (once per constraints file) the virtualenv and return its mlserver executable."""
    wanted = hashlib.sha256(CONSTRAINTS.read_bytes() + " ".join(PACKAGES).encode()).hexdigest()
    stamp = venv / ".installed"
    executable = venv / "bin" / "mlserver"
    if stamp.is_file() and stamp.read_text() == wanted and executable.exists():
        return executable
    log(f"creating {venv} ({', '.join(PACKAGES)}); takes a minute or two")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-c", str(CONSTRAINTS), *PACKAGES], check=True)
    stamp.write_text(wanted)
    return executable


def prepare(
    folder: Path,
    model: Path,
    name: str,
    *,
    max_batch_size: int,
    max_batch_time_s: float,
    threads: int,
) -> tuple[Path, int]:
    """A model repository for one configuration; returns it and the gRPC port chosen."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / name).mkdir(parents=True)
    shutil.copy(RUNTIME / "runtime.py", folder / name / "runtime.py")
    settings = json.loads((RUNTIME / "model-settings.json").read_text())
    settings |= {"name": name, "max_batch_size": max_batch_size, "max_batch_time": max_batch_time_s}
    settings["parameters"] = {"uri": str(model), "extra": {"intra_op_threads": threads}}
    (folder / name / "model-settings.json").write_text(json.dumps(settings, indent=2))
    server = json.loads((RUNTIME / "settings.json").read_text())
    grpc_port = free_port()
    server |= {"grpc_port": grpc_port, "http_port": free_port(), "metrics_port": free_port()}
    (folder / "settings.json").write_text(json.dumps(server, indent=2))
    return folder, grpc_port


def run(r: Runner) -> None:
    mlserver = ensure_venv()
    pinning = r.config.pinning
    for max_batch_size, max_batch_time_s in CONFIGS:
        name = (
            f"mlserver b={max_batch_size} t={max_batch_time_s * 1000:g}ms"
            if max_batch_size
            else "mlserver no batching"
        )
        folder, grpc_port = prepare(
            r.scratch / f"mlserver-{max_batch_size}",
            r.config.model_path,
            r.config.model,
            max_batch_size=max_batch_size,
            max_batch_time_s=max_batch_time_s,
            threads=pinning.server_threads,
        )
        command = [*pinning.prefix(pinning.server_cpus), str(mlserver), "start", str(folder)]
        with Service(name, command, grpc_port=grpc_port, cwd=folder) as service:
            service.wait_ready(r.config.ready_timeout_s, model=r.config.model)
            log(f"{name}: pid {service.pid} on {service.target}")
            for seq in SEQS:
                r.load(
                    service,
                    group="peers",
                    target="mlserver",
                    name=name,
                    api="v2",
                    seq=seq,
                    pinning=pinning,
                )
