"""Find model versions on disk: <repository>/<name>/<version>/model.onnx (+ weights graph)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OUTPUT_GRAPH = "model.onnx"
WEIGHTS_GRAPH = "model.with_weights.onnx"


# One strict rule for version folders and requested versions: ASCII digits, no leading zero,
# at most 18 digits. str.isdigit() also takes "²" (int() refuses it) and "１" or "١" (int()
# reads 1), and "01" would name the same version as "1"; all of those are not versions.
VERSION = re.compile(r"[1-9][0-9]{0,17}")
VERSION_RULE = "a positive decimal integer in ASCII digits without leading zeros, at most 18"


def parse_version(text: str) -> int | None:
    """The version a folder name or a request names, or None when it breaks the rule."""
    return int(text) if VERSION.fullmatch(text) else None


@dataclass(frozen=True)
class VersionFiles:
    """The graphs of one model version; the weights graph is optional."""

    name: str
    version: int
    output_graph: Path
    weights_graph: Path | None


def discover(repository: Path) -> list[VersionFiles]:
    """Every well-formed version folder by (name, version); others are logged, skipped."""
    if not repository.is_dir():
        log.error("model repository %s does not exist or is not a folder", repository)
        return []
    found = []
    for model_folder in sorted(p for p in repository.iterdir() if p.is_dir()):
        if model_folder.name.startswith("."):
            continue
        for version_folder in sorted(p for p in model_folder.iterdir() if p.is_dir()):
            if version_folder.name.startswith("."):
                continue  # staging folders of an export in progress
            version = parse_version(version_folder.name)
            if version is None:
                log.error("skipping %r: a version folder's name must be %s", str(version_folder),
                          VERSION_RULE)  # fmt: skip
                continue
            output_graph = version_folder / OUTPUT_GRAPH
            if not output_graph.is_file():
                log.error("skipping %s: no %s in it", version_folder, OUTPUT_GRAPH)
                continue
            weights_graph = version_folder / WEIGHTS_GRAPH
            found.append(
                VersionFiles(
                    name=model_folder.name,
                    version=version,
                    output_graph=output_graph,
                    weights_graph=weights_graph if weights_graph.is_file() else None,
                )
            )
    return sorted(found, key=lambda files: (files.name, files.version))
