"""Find model versions on disk: <repository>/<name>/<version>/model.onnx (+ weights graph), and
the version policy that picks which of them are served."""

from __future__ import annotations

import contextlib
import logging
import re
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from service.catalog import VERSION_RULE, parse_version

log = logging.getLogger(__name__)

OUTPUT_GRAPH = "model.onnx"
WEIGHTS_GRAPH = "model.with_weights.onnx"


@dataclass(frozen=True)
class VersionFiles:
    """The graphs of one model version; the weights graph is optional. identity changes when
    the folder is replaced (a new export renamed over it) or a file in it changes, so a poll
    can tell and reload."""

    name: str
    version: int
    output_graph: Path
    weights_graph: Path | None
    identity: tuple[int, ...] = ()
    # Why this version must not be loaded although its files are there (a symbolic link out
    # of the repository); the load fails with this reason, so clients are told.
    refused: str = ""


def _identity(version_folder: Path) -> tuple[int, ...]:
    """The folder's inode and each file's (inode, mtime, size), in name order: it changes when
    the folder is replaced, and when any file in it does (a copy that was not renamed in
    finishes its golden file or second graph after a poll saw them half-written)."""
    try:
        stamps = [version_folder.stat().st_ino]
        for path in sorted(version_folder.iterdir()):
            info = path.stat()
            stamps += [info.st_ino, info.st_mtime_ns, info.st_size]
    except OSError:  # removed while we looked: the next scan will not see it
        return ()
    return tuple(stamps)


@dataclass(frozen=True)
class Scan:
    """One look at the repository. What could not be listed is unknown, not removed: listed is
    False when the repository itself could not be (missing, unmounted, an I/O error), and
    unreadable names the models whose folders could not be."""

    versions: list[VersionFiles]
    listed: bool = True
    unreadable: frozenset[str] = frozenset()


def discover(
    repository: Path, *, quiet: bool = False, follow_symlinks: bool = False
) -> list[VersionFiles]:
    """Every well-formed version folder by (name, version); see scan()."""
    return scan(repository, quiet=quiet, follow_symlinks=follow_symlinks).versions


def relative_text(text: str, repository: Path) -> str:
    """text with the repository's absolute path taken out, as clients may see it: a file's
    path becomes relative to the repository (ONNX Runtime's errors name the absolute one)."""
    roots = {str(repository.absolute())}
    with contextlib.suppress(OSError):
        roots.add(str(repository.resolve()))
    # Longest first: a resolved path may extend the given one (/models -> /mnt/pvc/models).
    for root in sorted((r.rstrip("/") for r in roots if r.rstrip("/")), key=len, reverse=True):
        # Only the whole folder name: /models must not cut /models2/x to 2/x.
        text = re.sub(re.escape(root) + r"/", "", text)
        text = re.sub(re.escape(root) + r"(?![\w.-])", "<model repository>", text)
    return text


def _outside(path: Path, root: Path) -> bool:
    """Whether path, links followed, leaves root (an already resolved folder)."""
    try:
        return not path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a link loop
        return True


def _refusal(files: list[Path], repository: Path) -> str:
    """The load error for a version whose folders or graphs link out of the repository."""
    root = repository.resolve()
    leaving = [path for path in files if _outside(path, root)]
    if not leaving:
        return ""
    shown_path = leaving[0].relative_to(repository)
    return (
        f"{shown_path} is a symbolic link that leads out of the model repository; refused "
        "(start the server with --repository-follow-symlinks on to serve it)"
    )


# Characters a model's name may not hold: a control character or line break (it would forge
# log lines), or a lone surrogate (a name that is not valid UTF-8, as Python decodes it: no
# client can send it, and no protobuf message can hold it).
NOT_IN_NAMES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_skipped: set[str] = set()  # names logged already: each is said once, not at every scan


def is_model_name(name: str) -> bool:
    return not any(unicodedata.category(char) in NOT_IN_NAMES for char in name)


def _skip_once(name: str) -> None:
    if name not in _skipped:
        _skipped.add(name)
        log.warning(
            "skipping the folder %r: a model's name must be valid UTF-8 without control "
            "characters or line breaks",
            name,
        )


def scan(repository: Path, *, quiet: bool = False, follow_symlinks: bool = False) -> Scan:
    """Every well-formed version folder by (name, version); others are logged (at debug level
    when quiet, for repeated polls), skipped. Versions whose folders or graphs link out of the
    repository are marked refused unless follow_symlinks."""
    level = logging.DEBUG if quiet else logging.ERROR
    try:
        model_folders = sorted(p for p in repository.iterdir() if p.is_dir())
    except OSError as err:
        log.log(level, "cannot list the model repository %s: %s", repository, err)
        return Scan([], listed=False)
    found: list[VersionFiles] = []
    unreadable: set[str] = set()
    for model_folder in model_folders:
        if model_folder.name.startswith("."):
            continue
        if not is_model_name(model_folder.name):
            _skip_once(model_folder.name)
            continue
        try:
            found += _versions(model_folder, level, None if follow_symlinks else repository)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed while we looked (poll mode): the next scan will not see it
        except OSError as err:
            log.log(level, "cannot read %s: %s", model_folder, err)
            unreadable.add(model_folder.name)
    return Scan(
        sorted(found, key=lambda files: (files.name, files.version)),
        unreadable=frozenset(unreadable),
    )


def _versions(model_folder: Path, level: int, confined_to: Path | None) -> list[VersionFiles]:
    """The well-formed versions of one model; OSError when its folder cannot be read.
    confined_to: the repository its links must stay in (None: links may go anywhere)."""
    found = []
    for version_folder in sorted(p for p in model_folder.iterdir() if p.is_dir()):
        if version_folder.name.startswith("."):
            continue  # staging folders of an export in progress
        version = parse_version(version_folder.name)
        if version is None:
            log.log(
                level,
                "skipping %r: a version folder's name must be %s",
                str(version_folder),
                VERSION_RULE,
            )
            continue
        output_graph = version_folder / OUTPUT_GRAPH
        if not _is_file(output_graph):
            log.log(level, "skipping %s: no %s in it", version_folder, OUTPUT_GRAPH)
            continue
        weights_graph = version_folder / WEIGHTS_GRAPH
        graphs = [output_graph, *([weights_graph] if _is_file(weights_graph) else [])]
        refused = (
            ""
            if confined_to is None
            else _refusal([model_folder, version_folder, *graphs], confined_to)
        )
        found.append(
            VersionFiles(
                name=model_folder.name,
                version=version,
                output_graph=output_graph,
                weights_graph=weights_graph if _is_file(weights_graph) else None,
                identity=_identity(version_folder),
                refused=refused,
            )
        )
    return found


def _is_file(path: Path) -> bool:
    """Path.is_file(), except that an error other than "not there" is raised, not False."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
