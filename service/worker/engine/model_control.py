"""Model control: which versions are served, changed without a restart (Triton's modes).

none reads the repository once; poll rescans it; explicit changes only on load()/unload().
Every change keeps traffic whole: a version is loaded and warmed before the registry
serves it, and a withdrawn one is released only after the batcher has finished every
request already queued on it (settle). A version that fails to load is recorded with its
reason and never displaces a served one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.catalog import VersionPolicy
from service.dataplane import IndexEntry
from service.errors import (
    ModelControlDisabled,
    ModelLoadFailed,
    ModelNotFound,
    ShuttingDown,
)
from service.memory.budget import release_free_memory
from service.text import cut, shown
from service.worker.engine.onnx_model import BrokenModel, OnnxModel
from service.worker.engine.registry import ModelRegistry
from service.worker.engine.repository import (
    Scan,
    VersionFiles,
    discover,
    relative_text,
    scan,
)

log = logging.getLogger(__name__)

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
Key = tuple[str, int]
# A load failure's reasons in its status message (ONNX Runtime's own words, per version): a
# message travels in a call's trailing metadata, which gRPC clients bound (16 KiB by default).
LOAD_REASONS_CHARS = 1024


@dataclass(frozen=True, kw_only=True)
class Hooks:
    """What the controller needs from the layers around it.

    open_model: load and check a version's sessions (blocking; runs on a thread).
    prepare: warm a loaded version up and measure its caps (blocking; runs on a thread).
    settle: return once no request for the model is queued or computing.
    changed: the served set changed (metrics, health); called on the event loop.
    event: a load or unload ended (model name, action load|unload, outcome success|failure).
    """

    open_model: Callable[[VersionFiles], OnnxModel]
    prepare: Callable[[OnnxModel], None]
    settle: Callable[[OnnxModel], Awaitable[None]]
    changed: Callable[[], None] = lambda: None
    event: Callable[[str, str, str], None] = lambda name, action, outcome: None


class ModelController:
    """Owns every change to the registry; one change at a time."""

    def __init__(
        self,
        registry: ModelRegistry,
        repository: Path,
        *,
        mode: str,
        policy: VersionPolicy,
        hooks: Hooks,
        follow_symlinks: bool = False,
    ) -> None:
        self.registry = registry
        self.mode = mode
        self._repository = repository
        self._follow_symlinks = follow_symlinks
        self._policy = policy
        self._hooks = hooks
        self._lock = asyncio.Lock()
        self._states: dict[Key, tuple[str, str]] = {}
        self._files: dict[Key, VersionFiles] = {}  # of each served version
        self._failed: dict[Key, tuple[int, ...]] = {}  # identity that failed: not retried
        self._unreadable: frozenset[str] = frozenset()  # at the last poll; "": the repository
        self._changes: set[asyncio.Future[None]] = set()  # loads and unloads under way
        self._closed = False
        # Every version is opened and warmed on this one thread: the memory a version frees
        # at its unload then returns to one malloc arena that the next load reuses, where a
        # new thread each time could leave an arena's free top (up to the trim threshold)
        # resident per thread.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="model-load")

    def _discover(self, *, quiet: bool = False) -> list[VersionFiles]:
        return discover(self._repository, quiet=quiet, follow_symlinks=self._follow_symlinks)

    # -- the three modes ---------------------------------------------------------------------

    async def start(self, names: Iterable[str] = ()) -> None:
        """Load at start, not yet warm (the server warms every version before it is ready):
        all models, or in explicit mode those named (all when none is named). ModelNotFound
        when a named model has no folder: a typo must not start a server that serves nothing."""
        wanted = set(names)
        found = await asyncio.to_thread(self._discover)
        missing = sorted(wanted - {files.name for files in found})
        if missing:
            raise ModelNotFound(
                f"--load-model {', '.join(shown(name) for name in missing)}: no such model under "
                f"{self._repository} (expected <name>/<version>/model.onnx)"
            )
        async with self._lock:
            for name in sorted({files.name for files in found}):
                if wanted and name not in wanted:
                    continue
                await self._reconcile(name, [f for f in found if f.name == name], warm=False)

    async def poll(self) -> None:
        """Rescan the repository and follow it: new versions in, removed ones out. A model
        whose folder cannot be read (or all of them, when the repository cannot be listed)
        keeps what it serves: an unmounted volume or an NFS error is not a removal."""
        found = await asyncio.to_thread(
            scan, self._repository, quiet=True, follow_symlinks=self._follow_symlinks
        )
        self._warn_unreadable(found)
        if not found.listed:
            return
        versions = found.versions
        async with self._lock:
            for name in sorted({files.name for files in versions} | set(self.registry.names())):
                if name not in found.unreadable:
                    await self._reconcile(name, [f for f in versions if f.name == name])

    def _warn_unreadable(self, found: Scan) -> None:
        """Log once when (part of) the repository becomes unreadable, and once when it is back."""
        unreadable = found.unreadable if found.listed else frozenset({""})
        for name in sorted(unreadable - self._unreadable):
            what = "the repository" if not name else f"model folder {shown(name)}"
            log.warning(
                "cannot read %s under %s; serving what was loaded until it can be read",
                what,
                self._repository,
            )
        for name in sorted(self._unreadable - unreadable):
            what = "the repository" if not name else f"model folder {shown(name)}"
            log.info("%s under %s can be read again", what, self._repository)
        self._unreadable = unreadable

    async def poll_forever(self, interval_s: float) -> None:
        """poll() every interval_s until cancelled; a failed scan is logged, the next one runs."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
            except Exception:
                log.exception("repository poll failed; retrying in %.1fs", interval_s)

    async def load(self, name: str) -> None:
        """Explicit mode: (re)load a model's versions from disk, by the version policy."""
        self._allow("load")
        await self._to_the_end(self._load_model(name))

    async def unload(self, name: str) -> None:
        """Explicit mode: stop serving every version of a model; returns once its queued
        requests have finished and its sessions are released."""
        self._allow("unload")
        await self._to_the_end(self._unload_model(name))

    async def _to_the_end(self, change: Coroutine[Any, Any, None]) -> None:
        """Run a change to its end even when the caller goes away (a client's deadline cancels
        its call): cut off halfway, a version stayed LOADING or UNLOADING for good."""
        task = asyncio.ensure_future(change)
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)
        # Retrieved here too, so an error nobody awaits any more is not reported as lost.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.shield(task)

    async def _load_model(self, name: str) -> None:
        found = [files for files in await asyncio.to_thread(self._discover) if files.name == name]
        if not found:
            raise ModelNotFound(
                f"no model {shown(name)} in the repository (expected <name>/<version>/model.onnx)"
            )
        async with self._lock:
            for key in [k for k in self._failed if k[0] == name]:
                del self._failed[key]  # asked again: every version gets another try
            await self._reconcile(name, found)
            failed = [
                f"version {files.version}: {self._states[(name, files.version)][1]}"
                for files in found
                if self._failed.get((name, files.version)) == files.identity
            ]
        if failed:
            raise ModelLoadFailed(
                f"load failed for model {shown(name)}: "
                f"{cut('; '.join(failed), LOAD_REASONS_CHARS)}; "
                f"serving versions {sorted(self.registry.loaded(name))}"
            )

    async def _unload_model(self, name: str) -> None:
        async with self._lock:
            if not self.registry.loaded(name):
                raise ModelNotFound(f"model {shown(name)} is not loaded")
            for version in sorted(self.registry.loaded(name)):
                await self._unload(name, version, "unloaded")

    def close(self) -> None:
        """The server is draining: the served set stays as it is; load and unload answer
        UNAVAILABLE from now on (a load would spend the drain's CPU on a warm-up)."""
        self._closed = True

    def _allow(self, action: str) -> None:
        if self._closed:
            raise ShuttingDown(f"the server is shutting down; {action} on another replica")
        if self.mode != "explicit":
            raise ModelControlDisabled(
                f"explicit model load / unload is not allowed in --model-control-mode "
                f"{self.mode}; {action} needs a server started with --model-control-mode explicit"
            )

    # -- the index ----------------------------------------------------------------------------

    async def index(self, *, ready_only: bool = False) -> list[IndexEntry]:
        """Every version on disk or served, with its state; READY ones only when asked."""
        found = await asyncio.to_thread(self._discover, quiet=True)
        keys = {(f.name, f.version) for f in found} | set(self._states)
        keys |= {(m.spec.name, m.spec.version) for m in self.registry.all()}
        entries = []
        for name, version in sorted(keys):
            state, reason = self._states.get((name, version), (UNAVAILABLE, self._why_not()))
            if not ready_only or state == READY:
                entries.append(IndexEntry(name, version, state, reason))
        return entries

    def _why_not(self) -> str:
        """Why a version on disk that was never tried is not served."""
        return {
            "none": "not loaded: --model-control-mode none reads the repository only at start",
            "poll": f"not loaded: not selected by --version-policy {self._policy}, or not "
            "polled yet",
            "explicit": "not loaded: RepositoryModelLoad loads the versions that "
            f"--version-policy {self._policy} picks",
        }.get(self.mode, "not loaded")

    # -- changes ------------------------------------------------------------------------------

    async def _reconcile(self, name: str, found: list[VersionFiles], *, warm: bool = True) -> None:
        """Serve the versions of name that the policy picks among those that load; then
        withdraw the rest. Runs under the lock."""
        on_disk = {files.version: files for files in found}
        for key in [k for k in self._failed if k[0] == name and k[1] not in on_disk]:
            del self._failed[key]  # gone from disk: a new folder of that version gets a try
        while True:
            served = self.registry.loaded(name)
            failed = {v for v, f in on_disk.items() if self._failed.get((name, v)) == f.identity}
            # A served version whose new files failed keeps serving its old ones.
            desired = self._policy.select(v for v in on_disk if v not in failed or v in served)
            stale = [
                v
                for v in sorted(desired - failed)
                if v not in served or self._files.get((name, v)) != on_disk[v]
            ]
            results = [await self._load(on_disk[v], warm=warm) for v in stale]
            if all(results):
                break  # else pick again: a failed version leaves room for the next newest
        for version in sorted(set(self.registry.loaded(name)) - desired):
            reason = (
                "removed from the repository"
                if version not in on_disk
                else (f"not selected by --version-policy {self._policy}")
            )
            await self._unload(name, version, reason)
        for key in [k for k in self._states if k[0] == name]:
            if key[1] not in on_disk and key not in self._files:
                del self._states[key]  # neither on disk nor served: nothing to show

    async def _load(self, files: VersionFiles, *, warm: bool) -> bool:
        key = (files.name, files.version)
        serving = key in self._files
        if not serving:
            self._states[key] = (LOADING, "")
        log.info("loading %s version %d", files.name, files.version)
        try:
            if files.refused:
                raise BrokenModel(files.refused)
            loop = asyncio.get_running_loop()
            model = await loop.run_in_executor(self._loader, self._open, files, warm)
        except Exception as err:
            reason = str(err) if isinstance(err, BrokenModel) else f"unexpected error: {err!r}"
            log.error("not serving %s version %d: %s", files.name, files.version, reason)
            # Clients see the reason (RepositoryIndex, a failed load): no server paths in it.
            reason = relative_text(reason, self._repository)
            self._failed[key] = files.identity
            self._states[key] = (
                (READY, f"reload failed: {reason}") if serving else (UNAVAILABLE, reason)
            )
            self._hooks.event(files.name, "load", "failure")
            return False
        self._failed.pop(key, None)
        replaced = self.registry.publish(model)
        self._files[key] = files
        self._states[key] = (READY, "")
        self._hooks.changed()
        self._hooks.event(files.name, "load", "success")
        log.info(
            "serving %s version %d (d=%d, h=%d, causal=%s) on %s%s",
            files.name,
            files.version,
            model.spec.embed_dim,
            model.spec.num_heads,
            model.spec.causal,
            model.provider,
            " (reloaded)" if replaced else "",
        )
        if replaced is not None:
            await self._hooks.settle(replaced)
        return True

    def _open(self, files: VersionFiles, warm: bool) -> OnnxModel:
        model = self._hooks.open_model(files)
        if warm:
            self._hooks.prepare(model)
        return model

    async def _unload(self, name: str, version: int, reason: str) -> None:
        key = (name, version)
        model = self.registry.withdraw(name, version)
        self._files.pop(key, None)
        if model is None:
            return
        self._states[key] = (UNLOADING, reason)
        self._hooks.changed()
        log.info(
            "unloading %s version %d (%s) once its queued requests finish", name, version, reason
        )
        await self._hooks.settle(model)
        del model  # the last reference: ONNX Runtime frees the sessions
        release_free_memory()  # their arenas' memory, left in malloc's free lists
        self._states[key] = (UNAVAILABLE, reason)
        self._hooks.event(name, "unload", "success")
        log.info("unloaded %s version %d", name, version)
