"""The request path flows one way: api -> batching -> engine, never back up.

ops/server.py assembles every layer, so ops may import anything; the other layers may import
ops only for metrics and memory bookkeeping, never the server itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parent.parent / "service"
# What each layer may import from the others (shared top-level modules are always allowed).
ALLOWED = {
    "api": {"batching", "engine", "ops.metrics"},
    "batching": {"engine", "ops.metrics", "ops.memory_budget"},
    "engine": set(),
}


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


def _allowed(layer: str, name: str) -> bool:
    target = name.split(".")[0]
    if target == layer or target not in {"api", "batching", "engine", "ops"}:
        return True  # own layer, or a shared top-level module (errors, settings, text, generated)
    return any(name == rule or name.startswith(f"{rule}.") for rule in ALLOWED[layer])


def test_layers_import_only_downwards() -> None:
    wrong = []
    for layer in ALLOWED:
        for path in sorted((SERVICE / layer).glob("*.py")):
            wrong += [
                f"{path.relative_to(SERVICE)} imports service.{name}"
                for name in sorted(_service_imports(path))
                if not _allowed(layer, name)
            ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    upward = tmp_path / "bad.py"
    upward.write_text("from service.api.admission import admit\nfrom service.ops import server\n")
    names = _service_imports(upward)
    assert names == {"api.admission.admit", "ops.server"}
    assert not _allowed("engine", "api.admission.admit")
    assert not _allowed("batching", "ops.server")
    assert _allowed("batching", "ops.metrics")
