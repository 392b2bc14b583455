"""Model control without a server: version policy, the registry's swaps, the controller's
order of work (warm before served, drained before released) and the batcher's settle()."""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.catalog import VersionPolicy
from service.errors import ModelControlDisabled, ModelLoadFailed, ModelNotFound
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from service.worker.engine.caps import BatchCaps
from service.worker.engine.model_control import Hooks, ModelController
from service.worker.engine.onnx_model import BrokenModel
from service.worker.engine.registry import ModelRegistry
from service.worker.engine.repository import OUTPUT_GRAPH, VersionFiles


def run_async(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (no pytest plugin needed)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@pytest.mark.parametrize(
    ("text", "versions", "chosen"),
    [("all", [1, 3, 2], {1, 2, 3}), ("latest:1", [1, 3, 2], {3}), ("latest:2", [5], {5})],
)
def test_version_policy_selects(text: str, versions: list[int], chosen: set[int]) -> None:
    assert VersionPolicy.parse(text).select(versions) == chosen
    assert str(VersionPolicy.parse(text)) == text


@pytest.mark.parametrize("text", ["", "latest", "latest:0", "latest:-1", "newest:1", "ALL"])
def test_version_policy_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="all or latest:N"):
        VersionPolicy.parse(text)


@dataclass(frozen=True)
class _Spec:
    name: str
    version: int
    embed_dim: int = 8
    num_heads: int = 2
    causal: bool = False


@dataclass(eq=False)
class FakeModel:
    """Stands in for OnnxModel: what the registry, controller and batcher use of it."""

    spec: _Spec
    provider: str = "CPUExecutionProvider"
    warm: bool = False
    batch_caps: BatchCaps = field(default_factory=lambda: BatchCaps.uniform(64, 64))
    gate: asyncio.Event | None = None

    @property
    def key(self) -> str:
        return f"{self.spec.name}/{self.spec.version}"

    @property
    def label(self) -> str:
        return self.spec.name

    @property
    def described(self) -> str:
        return f"model '{self.spec.name}' version {self.spec.version}"

    def run(self, embeddings: np.ndarray, mask: np.ndarray, with_weights: bool, into=None):
        return embeddings + self.spec.version, None


def test_a_lookup_follows_every_publish_and_withdraw() -> None:
    registry: ModelRegistry[FakeModel] = ModelRegistry([FakeModel(_Spec("m", 1))], "m")
    assert registry.resolve("", "").key == registry.resolve("m", "1").key == "m/1"
    registry.publish(FakeModel(_Spec("m", 2)))
    assert registry.resolve("", "").key == "m/2"
    assert registry.resolve("m", "1").key == "m/1"
    registry.withdraw("m", 1)
    with pytest.raises(ModelNotFound, match="no version '1'"):
        registry.resolve("m", "1")
    replacement = FakeModel(_Spec("m", 2))
    registry.publish(replacement)
    assert registry.resolve("m", "") is replacement


def _publish(root: Path, name: str, version: int, content: bytes = b"ok") -> None:
    """Write a version folder beside its place, then rename it in (as export does)."""
    staging = root / name / f".{version}.staging"
    staging.mkdir(parents=True)
    (staging / OUTPUT_GRAPH).write_bytes(content)
    staging.rename(root / name / str(version))


class Recorder:
    """Hooks that record the order of events and open FakeModels (b"bad" files break)."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.events: list[tuple[str, ...]] = []
        self.settled: list[str] = []
        self.gate: threading.Event | None = None  # when set, open_model waits for it
        self.opening = threading.Event()

    def open_model(self, files: VersionFiles) -> FakeModel:
        if self.gate is not None:
            self.opening.set()
            self.gate.wait(10)
        golden = files.output_graph.parent / "golden.npz"
        if golden.exists() and golden.read_bytes() == b"half":
            raise BrokenModel("golden check failed: cannot read golden.npz")
        if files.output_graph.read_bytes() == b"bad":
            raise BrokenModel("ONNX Runtime cannot load it: not a model")
        return FakeModel(_Spec(files.name, files.version))

    def prepare(self, model: FakeModel) -> None:
        # Warm-up happens before the registry serves the version.
        assert model.key not in {m.key for m in self.registry.all()} or model.warm is False
        model.warm = True
        self.events.append(("warm", model.key))

    async def settle(self, model: FakeModel) -> None:
        self.settled.append(model.key)

    def event(self, name: str, action: str, outcome: str) -> None:
        self.events.append((action, outcome, name))

    def hooks(self) -> Hooks:
        return Hooks(
            open_model=self.open_model,  # type: ignore[arg-type]
            prepare=self.prepare,  # type: ignore[arg-type]
            settle=self.settle,  # type: ignore[arg-type]
            event=self.event,
        )


def _controller(root: Path, mode: str = "poll", policy: str = "all"):
    registry = ModelRegistry([], "m")
    recorder = Recorder(registry)
    controller = ModelController(
        registry, root, mode=mode, policy=VersionPolicy.parse(policy), hooks=recorder.hooks()
    )
    return controller, registry, recorder


def _served(registry: ModelRegistry) -> list[str]:
    return [m.key for m in registry.all()]


def _states(entries) -> dict[str, tuple[str, str]]:
    return {f"{e.name}/{e.version}": (e.state, e.reason) for e in entries}


@run_async
async def test_poll_serves_new_versions_warm_and_drops_removed_ones(tmp_path: Path) -> None:
    _publish(tmp_path, "m", 1)
    controller, registry, recorder = _controller(tmp_path)
    await controller.start()
    assert _served(registry) == ["m/1"]
    assert registry.resolve("m", "").warm is False  # the server warms what start() loads
    _publish(tmp_path, "m", 2)
    await controller.poll()
    assert _served(registry) == ["m/2", "m/1"]
    assert registry.resolve("", "").spec.version == 2
    assert registry.resolve("m", "2").warm
    (tmp_path / "m" / "1").rename(tmp_path / "m" / ".1.retired")
    await controller.poll()
    assert _served(registry) == ["m/2"]
    assert recorder.settled == ["m/1"]
    assert ("load", "success", "m") in recorder.events
    assert ("unload", "success", "m") in recorder.events
    assert "m/1" not in _states(await controller.index())  # gone from disk and unloaded


@run_async
async def test_a_broken_version_never_displaces_a_working_one(tmp_path: Path) -> None:
    _publish(tmp_path, "m", 1)
    controller, registry, recorder = _controller(tmp_path, policy="latest:1")
    await controller.start()
    _publish(tmp_path, "m", 2, b"bad")
    await controller.poll()
    assert _served(registry) == ["m/1"]
    state, reason = _states(await controller.index())["m/2"]
    assert state == "UNAVAILABLE"
    assert "cannot load it" in reason
    assert recorder.events.count(("load", "failure", "m")) == 1
    await controller.poll()  # the same broken folder is not tried again
    assert recorder.events.count(("load", "failure", "m")) == 1
    # A fixed version 3 replaces version 1 under latest:1.
    _publish(tmp_path, "m", 3)
    await controller.poll()
    assert _served(registry) == ["m/3"]
    assert recorder.settled == ["m/1"]
    ready = _states(await controller.index(ready_only=True))
    assert list(ready) == ["m/3"]


@run_async
async def test_a_replaced_folder_is_reloaded_in_place(tmp_path: Path) -> None:
    _publish(tmp_path, "m", 1)
    controller, registry, recorder = _controller(tmp_path)
    await controller.start()
    old = registry.resolve("m", "1")
    (tmp_path / "m" / "1").rename(tmp_path / "m" / ".1.retired")
    _publish(tmp_path, "m", 1, b"ok, again")
    await controller.poll()
    assert registry.resolve("m", "1") is not old
    assert recorder.settled == ["m/1"]


@run_async
async def test_a_failed_reload_keeps_the_served_version(tmp_path: Path) -> None:
    _publish(tmp_path, "m", 1)
    controller, registry, recorder = _controller(tmp_path, policy="latest:1")
    await controller.start()
    old = registry.resolve("m", "1")
    (tmp_path / "m" / "1").rename(tmp_path / "m" / ".1.retired")
    _publish(tmp_path, "m", 1, b"bad")
    for _ in range(2):  # tried once, not again
        await controller.poll()
        assert registry.resolve("m", "") is old
    state, reason = _states(await controller.index())["m/1"]
    assert state == "READY"
    assert reason.startswith("reload failed: ONNX Runtime cannot load it")
    assert recorder.events.count(("load", "failure", "m")) == 1
    assert recorder.settled == []


@run_async
async def test_explicit_mode_loads_and_unloads_on_request(tmp_path: Path) -> None:
    _publish(tmp_path, "a", 1)
    _publish(tmp_path, "b", 1)
    _publish(tmp_path, "broken", 1, b"bad")
    controller, registry, _ = _controller(tmp_path, mode="explicit")
    await controller.start(["a"])
    assert registry.names() == ["a"]
    assert _states(await controller.index())["b/1"] == (
        "UNAVAILABLE",
        "not loaded: RepositoryModelLoad loads the versions that --version-policy all picks",
    )
    await controller.load("b")
    assert registry.names() == ["a", "b"]
    await controller.unload("b")
    assert registry.names() == ["a"]
    assert _states(await controller.index())["b/1"] == ("UNAVAILABLE", "unloaded")
    with pytest.raises(ModelNotFound, match="no model 'nope'"):
        await controller.load("nope")
    with pytest.raises(ModelNotFound, match="not loaded"):
        await controller.unload("b")
    with pytest.raises(ModelLoadFailed, match="version 1: ONNX Runtime cannot load it"):
        await controller.load("broken")


@pytest.mark.parametrize("mode", ["none", "poll"])
@run_async
async def test_load_and_unload_refused_outside_explicit_mode(tmp_path: Path, mode: str) -> None:
    controller, _, _ = _controller(tmp_path, mode=mode)
    for call in (controller.load, controller.unload):
        with pytest.raises(ModelControlDisabled, match=f"--model-control-mode {mode}"):
            await call("m")


@run_async
async def test_batcher_settle_waits_for_queued_work_then_lets_go() -> None:
    """settle() returns only after every queued request of the runner is answered, and the
    batcher holds no reference to the runner afterwards (so its sessions can be freed)."""
    batcher = Batcher(BatchLimits(max_batch_size=4, max_queue_delay_s=0.05, max_queue_size=64))
    await batcher.start()
    model = FakeModel(_Spec("m", 1))
    x = np.ones((1, 3, 8), np.float32)
    calls = [asyncio.create_task(batcher.submit(model, x, with_weights=False)) for _ in range(6)]
    await asyncio.sleep(0)  # queued, not yet computed (the queue delay holds them)
    await batcher.settle(model)
    assert all(call.done() for call in calls)
    assert all(np.array_equal(call.result().output, x + 1) for call in calls)
    alive = weakref.ref(model)
    del model, calls
    gc.collect()
    assert alive() is None
    await batcher.stop()


def _sample(metric: Any, **labels: str) -> float:
    """A sample's value as prometheus-client reports it (no private state read)."""
    return next(
        sample.value
        for sample in next(iter(metric.collect())).samples
        if all(sample.labels.get(k) == v for k, v in labels.items())
    )


@run_async
async def test_served_set_follows_the_registry_and_warns_of_calls_too_large(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from grpc_health.v1 import health, health_pb2

    from service.frontend.served import ServedSet
    from service.observability import metrics
    from service.worker.server import served_rows

    registry = ModelRegistry([], "m")
    servicer = health.aio.HealthServicer()
    served, collector = ServedSet(servicer), metrics.ServedSetCollector()
    served.check_limits(lambda model: (model.spec.version * 100, 0), (150, 150))
    small, large = FakeModel(_Spec("m", 1)), FakeModel(_Spec("m", 2))
    registry.publish(small)  # type: ignore[arg-type]
    served.sync(registry, ready=True)  # type: ignore[arg-type]
    registry.publish(large)  # type: ignore[arg-type]
    served.sync(registry, ready=True)  # type: ignore[arg-type]
    collector.set(served_rows(registry.all(), ready=True))  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records if "m/2 takes calls" in r.getMessage()]
    assert not [r for r in caplog.records if "m/1 takes calls" in r.getMessage()]
    assert _sample(collector, model="m", version="2") == 1
    registry.withdraw("m", 1)
    registry.withdraw("m", 2)
    served.sync(registry, ready=True)  # type: ignore[arg-type]
    collector.set(served_rows(registry.all(), ready=True))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)  # the health update runs as a task
    ready = [s.name for s in next(iter(collector.collect())).samples if s.labels["model"] == "m"]
    assert ready == []
    reply = await servicer.Check(health_pb2.HealthCheckRequest(service="m"), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


@run_async
async def test_a_repository_or_model_folder_that_cannot_be_read_is_not_a_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unmounted volume, an NFS error or a folder the server may not read says nothing
    about which versions exist: poll keeps serving them (before, it unloaded every one)."""
    root = tmp_path / "models"
    _publish(root, "m", 1)
    _publish(root, "n", 1)
    controller, registry, recorder = _controller(root)
    await controller.start()
    root.rename(tmp_path / "away")  # the repository is gone for a moment
    await controller.poll()
    assert _served(registry) == ["m/1", "n/1"]
    (tmp_path / "away").rename(root)
    listdir = Path.iterdir

    def unreadable_m(path: Path):
        if path == root / "m":
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(Path, "iterdir", unreadable_m)
    (root / "n" / "1").rename(root / "n" / ".1.retired")  # a real removal still counts
    await controller.poll()
    assert _served(registry) == ["m/1"]
    monkeypatch.undo()
    (root / "m" / "1").rename(root / "m" / ".1.retired")
    await controller.poll()
    assert _served(registry) == []
    assert recorder.settled == ["n/1", "m/1"]


@run_async
async def test_explicit_mode_refuses_to_start_with_a_model_not_in_the_repository(
    tmp_path: Path,
) -> None:
    """--load-model with a typo: before, an error line and a server that served nothing."""
    _publish(tmp_path, "a", 1)
    controller, registry, _ = _controller(tmp_path, mode="explicit")
    with pytest.raises(ModelNotFound, match=r"--load-model 'nope': no such model under"):
        await controller.start(["a", "nope"])
    assert registry.names() == []


@run_async
async def test_a_load_or_unload_whose_caller_goes_away_still_completes(tmp_path: Path) -> None:
    """A client's deadline cancels its RepositoryModelLoad; before, the load stopped halfway
    and the index showed LOADING for good (and the version was never served)."""
    _publish(tmp_path, "a", 1)
    controller, registry, recorder = _controller(tmp_path, mode="explicit")
    await controller.start()
    _publish(tmp_path, "b", 1)
    recorder.gate = threading.Event()
    call = asyncio.ensure_future(controller.load("b"))
    assert await asyncio.to_thread(recorder.opening.wait, 10)
    call.cancel()  # the caller's deadline
    recorder.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(200):
        if "b" in registry.names():
            break
        await asyncio.sleep(0.01)
    assert _states(await controller.index())["b/1"] == ("READY", "")
    call = asyncio.ensure_future(controller.unload("b"))
    await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(200):
        if _states(await controller.index())["b/1"][0] == "UNAVAILABLE":
            break
        await asyncio.sleep(0.01)
    assert _states(await controller.index())["b/1"] == ("UNAVAILABLE", "unloaded")
    assert registry.names() == ["a"]


@run_async
async def test_a_version_copied_in_place_is_tried_again_once_any_file_of_it_changes(
    tmp_path: Path,
) -> None:
    """A folder copied straight into place (not renamed) that a poll saw with its golden file
    half written: once the copy finishes it loads (before, only model.onnx counted, so the
    version stayed UNAVAILABLE until model.onnx itself changed)."""
    _publish(tmp_path, "m", 1)
    controller, registry, _ = _controller(tmp_path)
    await controller.start()
    folder = tmp_path / "m" / "2"
    folder.mkdir()
    (folder / OUTPUT_GRAPH).write_bytes(b"ok")
    (folder / "golden.npz").write_bytes(b"half")
    await controller.poll()
    assert _states(await controller.index())["m/2"][0] == "UNAVAILABLE"
    (folder / "golden.npz").write_bytes(b"the whole golden file")
    await controller.poll()
    assert _served(registry) == ["m/2", "m/1"]


def test_model_config_writes_the_version_policy_as_triton_does() -> None:
    from service.frontend.v2_plane import _version_policy

    assert _version_policy("latest:2").latest.num_versions == 2
    assert _version_policy("all").WhichOneof("policy_choice") == "all"


@run_async
async def test_per_model_health_ends_as_the_last_change_left_it() -> None:
    """An update of the health entries that has to wait (a Watch call holds the entry while it
    writes) must not land after the next one: before, a load then an unload could leave the
    unloaded model SERVING."""
    from grpc_health.v1 import health_pb2

    from service.frontend.served import ServedSet

    class SlowFirstHealth:
        def __init__(self) -> None:
            self.status: dict[str, int] = {}
            self.release = asyncio.Event()
            self.calls = 0

        async def set(self, name: str, status: int) -> None:
            self.calls += 1
            if self.calls == 1:
                await self.release.wait()
            self.status[name] = status

    registry = ModelRegistry([], "m")
    fake = SlowFirstHealth()
    served = ServedSet(fake)  # type: ignore[arg-type]
    registry.publish(FakeModel(_Spec("m", 1)))  # type: ignore[arg-type]
    served.sync(registry, ready=True)  # type: ignore[arg-type]  # SERVING, held up
    await asyncio.sleep(0)
    registry.withdraw("m", 1)
    served.sync(registry, ready=True)  # type: ignore[arg-type]  # NOT_SERVING
    await asyncio.sleep(0.01)
    fake.release.set()
    await asyncio.sleep(0.01)
    assert fake.status["m"] == health_pb2.HealthCheckResponse.NOT_SERVING


@run_async
async def test_a_closed_controller_refuses_load_and_unload(tmp_path: Path) -> None:
    """While the server drains, the served set stays as it is (before, explicit mode still
    loaded and warmed models during the drain)."""
    from service.errors import ShuttingDown

    _publish(tmp_path, "a", 1)
    controller, registry, _ = _controller(tmp_path, mode="explicit")
    await controller.start([])
    controller.close()
    for call in (controller.load, controller.unload):
        with pytest.raises(ShuttingDown, match="shutting down"):
            await call("a")
    assert registry.names() == ["a"]
