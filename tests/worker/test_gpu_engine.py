"""The CUDA path's decisions, tested without a GPU: the driver check through a fake libcuda,
provider options (TF32 off, arena bounded), fallback disabled, thread defaults, warm-up
shapes, the fused-graph choice and the golden tolerance that follows TF32."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from export.pipeline import ExportResult
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from service.worker.engine import cuda, fused, onnx_model
from service.worker.engine.cuda import CPU, CUDA, CudaOptions, CudaUnavailable, DriverProbe
from service.worker.engine.golden import tolerance_for
from service.worker.engine.onnx_model import BrokenModel, OnnxModel, warm_up_shapes
from service.worker.engine.repository import VersionFiles

GiB = 1 << 30


class FakeLibrary:
    """Answers the few driver and NVML calls the probe makes, through ctypes byref()s."""

    def __init__(
        self,
        *,
        version: int,
        devices: int = 1,
        memory: int = 141 * GiB,
        release: str = "580.65.06",
        init: int = 0,
    ) -> None:
        self.version, self.devices, self.memory, self.release, self.init = (
            version,
            devices,
            memory,
            release,
            init,
        )

    @staticmethod
    def _set(ref: Any, value: int) -> None:
        ctypes.cast(ref, ctypes.POINTER(type(ref._obj))).contents.value = value

    def cuDriverGetVersion(self, ref: Any) -> int:  # the driver's own names
        self._set(ref, self.version)
        return 0

    def cuInit(self, flags: int) -> int:
        return self.init

    def cuDeviceGetCount(self, ref: Any) -> int:
        self._set(ref, self.devices)
        return 0

    def cuDeviceGet(self, ref: Any, ordinal: int) -> int:
        self._set(ref, ordinal)
        return 0

    def cuDeviceTotalMem_v2(self, ref: Any, device: Any) -> int:
        self._set(ref, self.memory)
        return 0

    def nvmlInit_v2(self) -> int:
        return 0

    def nvmlSystemGetDriverVersion(self, buffer: Any, size: Any) -> int:
        buffer.value = self.release.encode()
        return 0

    def nvmlShutdown(self) -> int:
        return 0


def loader(library: FakeLibrary | None):
    def load(name: str) -> FakeLibrary:
        if library is None:
            raise OSError(f"{name}: cannot open shared object file")
        return library

    return load


def test_this_build_needs_cuda_13() -> None:
    assert cuda.required_cuda_version() == 13000  # onnxruntime-gpu 1.31.1 is a CUDA 13.0 build
    assert cuda.version_text(12040) == "12.4"


def test_an_old_driver_is_named_as_the_cause() -> None:
    probe = cuda.probe_driver(loader(FakeLibrary(version=12080, release="570.86.15")))
    assert not probe.usable
    assert "NVIDIA driver 570.86.15 supports CUDA up to 12.8" in probe.reason
    assert "needs driver 580 or newer" in probe.reason
    assert "cuDriverGetVersion >= 13000" in probe.reason
    assert "libraries are not the problem" in probe.reason


def test_a_new_enough_driver_is_usable_and_reports_memory() -> None:
    probe = cuda.probe_driver(loader(FakeLibrary(version=13000)))
    assert probe.usable
    assert (probe.driver_cuda_version, probe.devices, probe.total_memory_bytes) == (
        13000,
        1,
        141 * GiB,
    )
    assert probe.describe() == "NVIDIA driver 580.65.06, CUDA 13.0 driver API, 1 device(s)"


@pytest.mark.parametrize(
    ("library", "reason"),
    [
        (None, "libcuda.so.1 is not found"),
        (FakeLibrary(version=13020, devices=0), "sees no GPU"),
        (FakeLibrary(version=13020, init=100), "cuInit failed"),
    ],
)
def test_no_usable_gpu_says_why(library: FakeLibrary | None, reason: str) -> None:
    probe = cuda.probe_driver(loader(library))
    assert not probe.usable
    assert reason in probe.reason
    assert not cuda.gpu_present(loader(library))


def test_provider_choice_follows_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(ort, "preload_dlls", lambda: None, raising=False)
    old = lambda: cuda.probe_driver(loader(FakeLibrary(version=12040)))  # noqa: E731
    new = lambda: cuda.probe_driver(loader(FakeLibrary(version=13000)))  # noqa: E731

    def never() -> DriverProbe:
        raise AssertionError("--provider cpu must not touch the driver")

    assert cuda.choose_providers("cpu", never) == [CPU]
    assert cuda.choose_providers("auto", old) == [CPU]
    assert cuda.choose_providers("auto", new) == [CUDA, CPU]
    assert cuda.choose_providers("cuda", new) == [CUDA, CPU]
    with pytest.raises(CudaUnavailable, match=r"--provider cuda: .*supports CUDA up to 12\.4"):
        cuda.choose_providers("cuda", old)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    with pytest.raises(CudaUnavailable, match="no CUDA provider"):
        cuda.choose_providers("cuda", new)


def test_provider_options_turn_tf32_off_and_bound_the_arena() -> None:
    assert CudaOptions().provider_options() == {
        "device_id": "0",
        "use_tf32": "0",
        "arena_extend_strategy": "kSameAsRequested",
    }
    limit = cuda.arena_limit_bytes(100 * GiB, 0.8, sessions=4)
    assert limit == 20 * GiB
    options = CudaOptions(use_tf32=True, gpu_mem_limit_bytes=limit).provider_options()
    assert options["use_tf32"] == "1"
    assert options["gpu_mem_limit"] == str(20 * GiB)
    assert cuda.arena_limit_bytes(0, 0.8, sessions=4) == 0  # memory unknown: no limit
    assert cuda.arena_limit_bytes(100 * GiB, 0, sessions=4) == 0  # fraction 0: no limit


def test_one_intra_op_thread_by_default_under_cuda_only() -> None:
    assert cuda.intra_op_threads_for(0, [CUDA, CPU]) == 1
    assert cuda.intra_op_threads_for(0, [CPU]) == 0  # all cores
    assert cuda.intra_op_threads_for(3, [CUDA, CPU]) == 3  # an explicit value stays


def test_warm_up_starts_at_the_largest_shape_on_cuda() -> None:
    assert warm_up_shapes(CUDA, 32, 512) == [(32, 512), (1, 16)]
    assert warm_up_shapes(CPU, 32, 512) == [(2, 1), (2, 16), (2, 128)]
    assert warm_up_shapes(CPU, 32, 8) == [(2, 1), (2, 8)]


def test_golden_tolerance_follows_tf32() -> None:
    assert tolerance_for(np.dtype(np.float32)) == (1e-4, 1e-5)
    assert tolerance_for(np.dtype(np.float32), tf32=True) == (5e-3, 1e-5)
    assert tolerance_for(np.dtype(np.float16), tf32=True) == (2e-2, 1e-3)


class RecordingSession:
    """Stands in for ort.InferenceSession: records providers and the fallback switch."""

    def __init__(self, path: str, options: Any, providers: list[Any]) -> None:
        self.path, self.providers, self.fallback = path, providers, True

    def disable_fallback(self) -> None:
        self.fallback = False


def test_cuda_sessions_get_options_and_no_silent_cpu_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(onnx_model.ort, "InferenceSession", RecordingSession)
    options = ort.SessionOptions()
    made = onnx_model._session(Path("m.onnx"), options, [CUDA, CPU], None)
    assert isinstance(made, RecordingSession)
    assert made.providers == [(CUDA, CudaOptions().provider_options()), CPU]
    assert made.fallback is False
    on_cpu = onnx_model._session(Path("m.onnx"), options, [CPU], None)
    assert isinstance(on_cpu, RecordingSession)
    assert on_cpu.providers == [CPU]


def _files(result: ExportResult) -> VersionFiles:
    return VersionFiles("small", 1, result.files.output_only, result.files.with_weights)


def test_graphs_split_across_providers_are_refused(
    small_export: ExportResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = onnx_model._session

    class OnCpuOnly:
        def __init__(self, session: ort.InferenceSession) -> None:
            self._session = session

        def __getattr__(self, name: str) -> Any:
            return getattr(self._session, name)

        def get_providers(self) -> list[str]:
            return [CPU]

    class OnCuda(OnCpuOnly):
        def get_providers(self) -> list[str]:
            return [CUDA, CPU]

    def split(path: Path, *args: Any) -> Any:
        session = real(path, *args)
        return OnCuda(session) if path.name == "model.onnx" else OnCpuOnly(session)

    monkeypatch.setattr(onnx_model, "_session", split)
    with pytest.raises(BrokenModel, match="different providers"):
        OnnxModel(_files(small_export), [CPU], 1)


def test_fused_graph_is_loaded_on_cuda_only_unless_forced(small_export: ExportResult) -> None:
    assert fused.wanted("auto", CUDA)
    assert not fused.wanted("auto", CPU)
    assert fused.wanted("on", CPU)
    assert not fused.wanted("off", CUDA)
    auto = OnnxModel(_files(small_export), [CPU], 1)
    assert auto.choose_output_graph(4, 64) == "unfused graph"
    assert not auto.uses_fused_graph
    forced = OnnxModel(_files(small_export), [CPU], 1, fused="on")
    assert forced.choose_output_graph(4, 64).startswith("fused graph: --fused-attention on")
    assert forced.uses_fused_graph
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 20, 64), dtype=np.float32)
    mask = np.zeros((3, 20), dtype=bool)
    mask[1, 7:] = True
    mask[2, :4] = True
    want, _ = auto.run(x, mask, with_weights=False)
    got, _ = forced.run(x, mask, with_weights=False)
    np.testing.assert_allclose(got[~mask], want[~mask], atol=1e-5, rtol=0)


def test_fused_graph_is_chosen_only_when_faster_everywhere() -> None:
    faster = [fused.Timing(8, 128, 2e-3, 1e-3), fused.Timing(32, 512, 9e-3, 8e-3)]
    mixed = [fused.Timing(8, 128, 2e-3, 1e-3), fused.Timing(32, 512, 8e-3, 9e-3)]
    assert fused.decide("auto", faster)[0]
    use, why = fused.decide("auto", mixed)
    assert not use
    assert "not faster (8x128: fused 1.000 ms, unfused 2.000 ms; 32x512" in why
    assert not fused.decide("auto", [])[0]
    assert fused.comparison_shapes(32, 512) == [(8, 128), (32, 512)]
    assert fused.comparison_shapes(4, 64) == [(4, 64)]


def test_warm_up_runs_on_every_compute_thread() -> None:
    seen: list[str] = []

    async def scenario() -> None:
        batcher = Batcher(
            BatchLimits(
                max_batch_size=4, max_queue_delay_s=0, max_queue_size=8, max_inflight_batches=3
            )
        )
        await batcher.on_every_thread(lambda: seen.append(threading.current_thread().name))
        await batcher.stop()

    asyncio.run(scenario())
    assert len(seen) == 3
    assert len(set(seen)) == 3
    assert all(name.startswith("batch-compute") for name in seen)


def test_gpu_memory_is_shared_over_the_sessions_found(small_export: ExportResult) -> None:
    files = _files(small_export)  # output, weights and fused graphs
    assert onnx_model.count_sessions([files], "auto", CUDA) == 3
    assert onnx_model.count_sessions([files], "auto", CPU) == 2
    assert onnx_model.count_sessions([files, files], "off", CUDA) == 4
    probe = lambda: cuda.probe_driver(loader(FakeLibrary(version=13000, memory=100 * GiB)))  # noqa: E731
    options = cuda.cuda_options_for(
        [CUDA, CPU], tf32=False, memory_fraction=0.8, sessions=4, probe=probe
    )
    assert options == CudaOptions(use_tf32=False, gpu_mem_limit_bytes=20 * GiB)
    assert cuda.cuda_options_for([CPU], tf32=True, memory_fraction=0.8, sessions=4) is None


def test_a_fused_graph_that_cannot_load_drops_only_itself(
    small_export: ExportResult, tmp_path: Path
) -> None:
    broken = tmp_path / "model.fused.onnx"
    broken.write_bytes(b"not onnx")
    model = OnnxModel(_files(small_export), [CPU], 1)  # auto on CPU: fused not loaded at all
    assert model._load_fused(broken, ort.SessionOptions(), [CPU], None) is None
    folder = tmp_path / "v"
    folder.mkdir()
    for graph in (small_export.files.output_only, small_export.files.with_weights):
        (folder / graph.name).write_bytes(graph.read_bytes())
    (folder / "model.fused.onnx").write_bytes(b"not onnx")
    files = VersionFiles("small", 1, folder / "model.onnx", folder / "model.with_weights.onnx")
    with pytest.raises(BrokenModel, match=r"cannot load model\.fused\.onnx"):
        OnnxModel(files, [CPU], 1, fused="on")
