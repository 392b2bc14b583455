"""bench/gpu.sh, the prepared GPU check: its CPU dry run passes here, and without a usable GPU
the real run fails loudly instead of measuring the CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from bench import gpu_check, gpu_preflight, gpu_probe
from tests.harness.reference import cpu_session

ROOT = Path(__file__).resolve().parents[2]


def _models(model_repository: Path, tmp_path: Path) -> Path:
    """The session's small float32 and float16 exports under the names the check expects."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "mha").symlink_to(model_repository / "small")
    (models / "mha16").symlink_to(model_repository / "half")
    return models


def test_dry_run_checks_everything_on_cpu(model_repository: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GPU_MODELS": str(_models(model_repository, tmp_path)),
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
    }
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DRY RUN on CPU (GPU parts skipped): passed" in done.stdout
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["failures"] == []
    assert report["elapsed_s"] < 120
    assert set(report["providers"]["float32"]) == {
        "output",
        "output+attention_weights",
        "output(fused)",
    }
    assert set(report["float16_parity"]) == {"1x", "4x", "16x", "64x"}
    assert report["float32_parity"]["tf32_off"]["relative"] < 1e-5
    assert report["fused"]["parity"]["relative"] < 1e-5
    assert report["server"]["one_request_seq128"]["p50_ms"] > 0
    assert report["server"]["requests_of_64_seq128"]["sequences_per_s"] > 0
    series = report["server"]["metrics"]
    assert series["attention_process_cpu_seconds_total"]["process=worker"] > 0


def test_without_a_usable_gpu_the_real_run_fails_loudly(
    model_repository: Path, tmp_path: Path
) -> None:
    code = gpu_check.main(["--models", str(_models(model_repository, tmp_path))])
    assert code == 1  # never a CPU measurement presented as a GPU one


def test_numpy_reference_equals_onnx_runtime(model_repository: Path) -> None:
    graph = sorted((model_repository / "small").glob("*/model.onnx"))[-1]
    reference = gpu_probe.numpy_reference(graph)
    rng = np.random.default_rng(0)
    x, mask = gpu_probe.padded_batch(rng, 4, 24, 64)
    (got,) = cpu_session(graph).run(
        None, {"embeddings": x.astype(np.float32), "key_padding_mask": mask}
    )
    found = gpu_probe.errors(got, reference(x.astype(np.float32), mask), mask)
    assert found["nonfinite"] == 0
    assert found["relative"] < 1e-5
    assert mask[1:].any()  # padding at the end, the start and in holes


def test_an_unusable_fused_graph_fails_the_check_but_not_the_measurements(
    model_repository: Path, tmp_path: Path
) -> None:
    """A fused graph that cannot load (on CUDA: an Attention kernel that refuses the mask, say)
    is reported; it does not stop the float16, in-flight and server figures with a traceback."""
    models = tmp_path / "models"
    shutil.copytree(model_repository / "small", models / "mha")
    shutil.copytree(model_repository / "half", models / "mha16")
    for fused in (models / "mha").glob("*/model.fused.onnx"):
        fused.write_bytes(b"not an onnx graph")
    result = tmp_path / "gpu-check.json"
    code = gpu_check.main(
        [
            "--models",
            str(models),
            "--dry-run",
            "--max-batch-size",
            "2",
            "--max-seq-len",
            "16",
            "--inflight-calls",
            "4",
            "--json",
            str(result),
        ]
    )
    assert code == 1
    report = json.loads(result.read_text())
    assert "mha" in report["fused_load_errors"]
    assert any("fused graph of mha not usable" in failure for failure in report["failures"])
    assert set(report["float16_parity"]) == {"1x", "4x", "16x", "64x"}
    assert report["fused"]["error"]
    assert report["server"]["requests_of_64_seq128"]["sequences_per_s"] > 0


def test_a_compute_op_on_cpu_under_cuda_fails_the_check() -> None:
    """session.get_providers() lists CUDA even when a node of the graph ran on CPU (an op
    without a CUDA kernel, e.g. an Attention form it refuses): the profiler's placement is
    judged, shape computations on CPU aside."""
    ok = {"nonfinite": 0, "relative": 1e-6}
    placement = {
        "unfused": {"MatMul": [gpu_check.CUDA], "Shape": [gpu_check.CPU]},
        "fused": {"Attention": [gpu_check.CPU], "MatMul": [gpu_check.CUDA]},
    }
    report = {
        "dry_run": False,
        "float32_parity": {"tf32_off": ok},
        "float16_parity": {"1x": ok, "4x": ok},
        "fused": {"parity": ok, "float16_parity_1x": ok, "ops_ran_on": placement},
    }
    failures = gpu_check.judge(report)
    assert len(failures) == 1
    assert "['Attention'] ran on CPU" in failures[0]
    assert failures[0].startswith("fused graph")
    assert gpu_check.judge({**report, "dry_run": True}) == []  # on CPU every op is on CPU


def test_the_real_run_fails_in_seconds_before_exporting_anything(tmp_path: Path) -> None:
    """No usable GPU (here: no libcuda): gpu.sh stops at its preflight with the reason, before
    minutes of exports or measurements are spent on a scarce device machine."""
    models = tmp_path / "models"
    env = {
        **os.environ,
        "GPU_MODELS": str(models),
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_BUNDLE": str(tmp_path / "no-bundle"),
    }
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "bench/gpu.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "GPU CHECK FAILED before starting" in done.stderr
    assert "libcuda.so.1" in done.stderr
    assert not models.exists()  # nothing exported
    assert time.monotonic() - started < 60


def test_preflight_names_a_cpu_build_of_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device image's own python has onnxruntime 1.30 (CPU build): named as the cause."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "__version__", "1.30.0")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    found = gpu_preflight.problems(dry_run=False)
    assert any("1.30.0" in problem and "not the pinned" in problem for problem in found)
    assert any("no CUDA provider" in problem for problem in found)
    assert gpu_preflight.problems(dry_run=True) == []


def test_nvidia_library_folders_are_found_on_any_path_entry(tmp_path: Path) -> None:
    """onnxruntime-gpu installed apart from the NVIDIA wheels (gpu.sh's --target install of a
    carried bundle) finds their libraries through LD_LIBRARY_PATH built from these."""
    for part in ("a/nvidia/cu13/lib", "a/nvidia/cudnn/lib", "b/nvidia/cu13/lib"):
        (tmp_path / part).mkdir(parents=True)
    found = gpu_preflight.nvidia_lib_dirs(
        [str(tmp_path / "a"), str(tmp_path / "none"), str(tmp_path / "b")]
    )
    assert found == [
        str(tmp_path / p) for p in ("a/nvidia/cu13/lib", "a/nvidia/cudnn/lib", "b/nvidia/cu13/lib")
    ]


def _tiny_wheel(folder: Path) -> Path:
    """A minimal valid wheel (module gpu_bundle_probe), padded so that it splits in pieces."""
    wheel = folder / "gpu_bundle_probe-1.0-py3-none-any.whl"
    info = "gpu_bundle_probe-1.0.dist-info"
    files = {
        "gpu_bundle_probe.py": "PAD = " + repr(os.urandom(4096).hex()) + "\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-bundle-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(
            f"{info}/RECORD", "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
        )
    return wheel


def test_carried_wheel_pieces_are_reassembled_and_installed(tmp_path: Path) -> None:
    """A wheel over the carry limit travels as NAME.whl.part-NN (bench/gpu_bundle.sh); gpu.sh
    puts it back together and installs it beside the machine's Python before its preflight."""
    bundle, site = tmp_path / "bundle", tmp_path / "site"
    bundle.mkdir()
    data = _tiny_wheel(tmp_path).read_bytes()
    half = len(data) // 2
    (bundle / "gpu_bundle_probe-1.0-py3-none-any.whl.part-00").write_bytes(data[:half])
    (bundle / "gpu_bundle_probe-1.0-py3-none-any.whl.part-01").write_bytes(data[half:])
    env = {
        **os.environ,
        "GPU_MODELS": str(tmp_path / "models"),
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_BUNDLE": str(bundle),
        "GPU_SITE": str(site),
    }
    done = subprocess.run(
        ["bash", "bench/gpu.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "installing carried wheels" in done.stdout, done.stdout + done.stderr
    assert (site / "gpu_bundle_probe.py").is_file()
    assert done.returncode == 1  # then the preflight: no GPU here


def test_a_session_that_lost_its_cuda_provider_is_named_with_the_libraries() -> None:
    """ONNX Runtime creates the session on CPU when the CUDA provider cannot load: the check
    stops there (before the largest-shape run) and says where to look."""

    class Session:
        def get_providers(self) -> list[str]:
            return [gpu_check.CPU]

    class Model:
        key = "mha/1"

        def _sessions(self) -> dict[str, Session]:
            return {"output": Session()}

    with pytest.raises(gpu_check.CheckFailed, match="CUDA provider did not load"):
        gpu_check.check_sessions(Model(), [gpu_check.CUDA, gpu_check.CPU])  # type: ignore[arg-type]
    assert gpu_check.check_sessions(Model(), [gpu_check.CPU]) == {"output": [gpu_check.CPU]}  # type: ignore[arg-type]


def test_the_servers_gpu_and_process_series_are_judged() -> None:
    processes = {
        name: {f"process={role}": 1.0 for role in gpu_check.ROLES}
        for name in gpu_check.PROCESS_SERIES
    }
    board = "gpu=0,gpu_uuid=GPU-1"
    gpu = {name: {board: 0.5} for name in gpu_check.GPU_SERIES}
    gpu["attention_gpu_memory_used_bytes"] = {board: 2.0e9}
    gpu["attention_gpu_memory_total_bytes"] = {board: 1.4e11}
    assert gpu_check.judge_series({**processes, **gpu}, gpu=True) == []
    assert gpu_check.judge_series(processes, gpu=False) == []  # the dry run, on CPU
    assert gpu_check.judge_series(None, gpu=True) == []  # the server was never reached
    (missing,) = gpu_check.judge_series(processes, gpu=True)
    assert "nvidia-ml-py" in missing
    overfull = {**gpu, "attention_gpu_memory_used_bytes": {board: 2e11}}
    assert gpu_check.judge_series({**processes, **overfull}, gpu=True) == [
        "GPU memory used 200000000000.0 not within total 140000000000.0"
    ]
    no_worker = {name: {"process=supervisor": 1.0} for name in gpu_check.PROCESS_SERIES}
    assert "no attention_process_cpu_seconds_total for process worker" in (
        gpu_check.judge_series(no_worker, gpu=False)
    )
