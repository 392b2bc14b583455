"""Imports follow the data flow and the process picture.

app/ assembles the processes, so it may import anything. The front end (per-request protocol
work) and the worker (batcher, ONNX Runtime) are separate processes and share only the
leaves: ipc (shared memory, control messages), transport (tensor codecs, TLS, gRPC options),
observability (metrics, tracing), memory, and the shared top-level modules (catalog,
dataplane, errors, settings, text, generated). The client side (client, healthcheck, plot)
imports nothing of the server.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SERVICE = Path(__file__).resolve().parent.parent / "service"
LEAVES = {"transport", "observability", "memory", "ipc"}
PACKAGES = {"app", "frontend", "worker", *LEAVES}
# What each package (or sub-package) may import from the others, beyond itself and the shared
# top-level modules.
ALLOWED: dict[str, set[str]] = {
    # Front ends and the worker are separate processes: neither imports the other.
    "frontend": LEAVES,
    "frontend/rest": {"frontend", *LEAVES},  # the HTTP/REST front end, on V2Plane
    "worker": {"observability", "memory", "ipc"},
    "worker/engine": {"observability", "memory"},
    "ipc": set(),
    "transport": set(),
    "observability": set(),
    "memory": set(),
}
CLIENT_MODULES = ["client.py", "healthcheck.py", "plot.py"]
CLIENT_ALLOWED = {"transport"}


def _service_imports(path: Path) -> set[str]:
    """Dotted names under service. that a module imports (`from service.x import y` gives x.y)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("service"):
            base = node.module.removeprefix("service").lstrip(".")
            imported.update(f"{base}.{alias.name}".lstrip(".") for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(
                alias.name.removeprefix("service.")
                for alias in node.names
                if alias.name.startswith("service.")
            )
    return imported


def _allowed(package: str, name: str, rules: set[str]) -> bool:
    """Whether code in package (e.g. "worker/engine") may import service.<name>."""
    own = package.replace("/", ".")
    if name == own or name.startswith(f"{own}."):
        return True
    if name.split(".")[0] not in PACKAGES:
        return True  # a shared top-level module (errors, settings, text, generated)
    if package == "worker/engine" and name.startswith("worker."):
        return False  # the engine is below the batcher: it never imports it back
    if package == "worker" and name.startswith("worker."):
        return True
    return any(name == rule or name.startswith(f"{rule}.") for rule in rules)


def _violations(package: str, paths: list[Path], rules: set[str]) -> list[str]:
    return [
        f"{path.relative_to(SERVICE)} imports service.{name}"
        for path in paths
        for name in sorted(_service_imports(path))
        if not _allowed(package, name, rules)
    ]


def test_packages_import_only_downwards() -> None:
    wrong = []
    for package, rules in ALLOWED.items():
        folder = SERVICE / package
        paths = (
            sorted(folder.glob("*.py"))
            if package != "worker"
            else [path for path in sorted(folder.rglob("*.py")) if "engine" not in path.parts]
        )
        wrong += _violations(package, paths, rules)
    assert not wrong, "\n".join(wrong)


def test_the_client_imports_nothing_of_the_server() -> None:
    paths = [SERVICE / name for name in CLIENT_MODULES]
    wrong = [
        f"{path.name} imports service.{name}"
        for path in paths
        for name in sorted(_service_imports(path))
        if name.split(".")[0] in PACKAGES - CLIENT_ALLOWED
    ]
    assert not wrong, "\n".join(wrong)


def test_a_front_end_process_never_loads_onnxruntime() -> None:
    code = (
        "import sys, service.frontend.server, service.app.supervisor;"
        "assert 'onnxruntime' not in sys.modules, 'a front end imported onnxruntime'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SERVICE.parent)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    upward = tmp_path / "bad.py"
    upward.write_text(
        "from service.frontend.admission import admit\nfrom service.app import server\n"
    )
    names = _service_imports(upward)
    assert names == {"frontend.admission.admit", "app.server"}
    assert not _allowed("worker/engine", "frontend.admission.admit", ALLOWED["worker/engine"])
    assert not _allowed("worker", "app.server", ALLOWED["worker"])
    assert not _allowed("worker/engine", "worker.batching.batcher", ALLOWED["worker/engine"])
    assert _allowed("worker", "worker.engine.onnx_model", ALLOWED["worker"])
    assert _allowed("worker", "observability.metrics", ALLOWED["worker"])
    assert not _allowed("transport", "observability.metrics", ALLOWED["transport"])


def test_the_formatter_formats_everything() -> None:
    """No code is exempt from ruff's formatting: its skip and off comments are refused."""
    root = SERVICE.parent
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    marker = "fmt: " + "skip"  # not written whole, or this file would hold one
    exempt = [
        name
        for name in tracked
        if (root / name).exists()
        and any(m in (root / name).read_text() for m in (marker, "fmt: " + "off"))
    ]
    assert exempt == []
