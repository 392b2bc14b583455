"""Write model versions into models/<name>/<version>/ atomically."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# The server's rule (service/worker/engine/repository.py): ASCII digits, no leading zero, at most 18
# digits, so every folder name is one int64 version and no two names mean the same version.
VERSION_FOLDER = re.compile(r"[1-9][0-9]{0,17}")
MAX_VERSION = 10**18 - 1


class VersionExistsError(FileExistsError):
    """The version folder exists and --force was not given."""


def existing_versions(model_folder: Path) -> list[int]:
    """Numeric version folders of one model, ascending."""
    if not model_folder.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in model_folder.iterdir()
        if entry.is_dir() and VERSION_FOLDER.fullmatch(entry.name)
    )


def next_version(model_folder: Path) -> int:
    """One past the newest version, or 1 for a new model."""
    versions = existing_versions(model_folder)
    return versions[-1] + 1 if versions else 1


def write_version(
    model_folder: Path, version: int, fill: Callable[[Path], None], *, force: bool
) -> Path:
    """Fill a temporary folder beside the target and rename it into place, so a reader
    never sees a half-written version and a failed export leaves nothing behind."""
    target = model_folder / str(version)
    if target.exists() and not force:
        raise VersionExistsError(f"{target} already exists; pass --force to replace it")
    model_folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}.staging-", dir=model_folder))
    try:
        staging.chmod(0o755)  # mkdtemp makes it 0700; a non-root server must read it
        fill(staging)
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{version}.retired-", dir=model_folder))
            target.rename(retired / "old")
            staging.rename(target)
            shutil.rmtree(retired)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
