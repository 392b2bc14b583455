"""python -m bench.gpu_preflight: what bench/gpu.sh needs, checked in seconds before anything
is exported or measured, so a device run without onnxruntime-gpu, a driver or the server's
packages fails at once with the reason instead of after minutes.

--nvidia-lib-dirs prints the NVIDIA wheels' library folders on this Python's path, joined by
':', for LD_LIBRARY_PATH: onnxruntime.preload_dlls() looks for them only beside onnxruntime
itself, so an onnxruntime-gpu installed elsewhere (--target, as bench/gpu.sh does with a
carried bundle) would not find the CUDA libraries of the machine's own wheels.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

PINNED_ONNXRUNTIME = "1.31.1"  # pyproject.toml, constraints-gpu.txt
# What the check and the server import: the engine, the gRPC server (health, reflection, the
# generated code, which refuses an older protobuf or grpcio than it was generated for) and
# the numpy reference's onnx; pynvml, whose NVML series the check expects from the server.
MODULES = (
    "numpy",
    "onnx",
    "prometheus_client",
    "pynvml",
    "service.worker.server",
    "service.frontend.server",
    "bench.gpu_check",
    "bench.loadgen",
)


def nvidia_lib_dirs(paths: list[str]) -> list[str]:
    """nvidia/*/lib folders under the given sys.path entries, in path order."""
    found: list[str] = []
    for entry in paths:
        for folder in sorted(Path(entry or ".").glob("nvidia/*/lib")):
            if folder.is_dir() and str(folder) not in found:
                found.append(str(folder))
    return found


def problems(dry_run: bool) -> list[str]:
    """Everything missing for the check; empty when it can run."""
    found = []
    try:
        import onnxruntime as ort
    except ImportError as err:
        return [f"onnxruntime does not import ({err}): bring onnxruntime-gpu {PINNED_ONNXRUNTIME}"]
    if not dry_run:
        if ort.__version__ != PINNED_ONNXRUNTIME:
            found.append(
                f"onnxruntime {ort.__version__} at {Path(ort.__file__).parent}, not the pinned "
                f"onnxruntime-gpu {PINNED_ONNXRUNTIME}"
            )
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            found.append(
                f"onnxruntime {ort.__version__} has no CUDA provider (a CPU build): bring "
                f"onnxruntime-gpu {PINNED_ONNXRUNTIME} (bench/gpu_bundle.sh)"
            )
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # ImportError, or generated code refusing its runtime
            found.append(f"{name} does not import: {type(err).__name__}: {err}")
    if not dry_run and not found:
        from service.worker.engine import cuda

        probe = cuda.probe_driver()
        if not probe.usable:
            found.append(probe.reason)
    return found


def main(argv: list[str]) -> int:
    if argv == ["--nvidia-lib-dirs"]:
        print(":".join(nvidia_lib_dirs(sys.path)))
        return 0
    dry_run = argv == ["--dry-run"]
    found = problems(dry_run)
    for problem in found:
        print(f"GPU CHECK FAILED before starting: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
