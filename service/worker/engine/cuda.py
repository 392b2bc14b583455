"""Is CUDA usable here, and with which ONNX Runtime provider options: asked of the driver
itself before any session exists, so a CPU machine logs no CUDA errors and an old driver is
named as the cause instead of the libraries."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnxruntime as ort

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# A library loader: ctypes.CDLL in production, a fake in tests (no GPU needed to test this).
Loader = Callable[[str], Any]
# NVIDIA's table: the oldest Linux driver branch for each CUDA major version.
DRIVER_FOR_CUDA_MAJOR = {12: "525", 13: "580"}


class CudaUnavailable(RuntimeError):
    """--provider cuda cannot be honoured; the message names the driver or library at fault."""


def required_cuda_version() -> int:
    """cuDriverGetVersion's encoding (1000 x major + 10 x minor) of the CUDA version this
    onnxruntime build needs: onnxruntime-gpu 1.31.1 is a CUDA 13.0 build, so 13000."""
    try:
        from onnxruntime.capi import build_and_package_info
    except ImportError:  # a build without the file: the version this project pins
        return 13000
    text = getattr(build_and_package_info, "cuda_version", "") or "13.0"
    major, _, minor = text.partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


def version_text(encoded: int) -> str:
    """13000 -> '13.0', 12040 -> '12.4' (cuDriverGetVersion's encoding)."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


@dataclass(frozen=True)
class DriverProbe:
    """What the CUDA driver said. usable is False with reason set when it cannot serve."""

    usable: bool
    reason: str
    driver_cuda_version: int = 0  # cuDriverGetVersion, e.g. 13000; 0 = not asked
    driver_release: str = ""  # NVML's driver version, e.g. "580.65.06"; "" = unknown
    devices: int = 0
    total_memory_bytes: int = 0  # of device 0

    def describe(self) -> str:
        release = f"NVIDIA driver {self.driver_release}, " if self.driver_release else ""
        cuda = version_text(self.driver_cuda_version) if self.driver_cuda_version else "?"
        return f"{release}CUDA {cuda} driver API, {self.devices} device(s)"


def _driver_release(load: Loader) -> str:
    """The driver's release number from NVML, or '' (NVML is optional: only for messages)."""
    try:
        nvml = load("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return ""
        buffer = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buffer, ctypes.c_uint(96)) == 0
        nvml.nvmlShutdown()
        return buffer.value.decode("ascii", "replace") if ok else ""
    except (OSError, AttributeError):
        return ""


def probe_driver(load: Loader = ctypes.CDLL, required: int | None = None) -> DriverProbe:
    """Load libcuda.so.1, check cuDriverGetVersion >= required (this build's CUDA version),
    then cuInit and the device count."""
    required = required_cuda_version() if required is None else required
    try:
        cuda = load("libcuda.so.1")
    except OSError as err:
        return DriverProbe(False, f"the CUDA driver library libcuda.so.1 is not found ({err})")
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return DriverProbe(False, "cuDriverGetVersion failed: the CUDA driver is broken")
    release = _driver_release(load)
    if version.value < required:
        major = required // 1000
        needed = DRIVER_FOR_CUDA_MAJOR.get(major, "a newer one")
        found = f"NVIDIA driver {release}" if release else "the installed NVIDIA driver"
        return DriverProbe(
            False,
            f"{found} supports CUDA up to {version_text(version.value)} (cuDriverGetVersion "
            f"{version.value}), but onnxruntime-gpu {ort.__version__} is built for CUDA "
            f"{version_text(required)}: it needs driver {needed} or newer (cuDriverGetVersion "
            f">= {required}). Upgrade the driver on the host; the CUDA libraries are not the "
            "problem",
            version.value,
            release,
        )
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return DriverProbe(False, "cuInit failed: no usable GPU", version.value, release)
    if count.value < 1:
        return DriverProbe(False, "the CUDA driver sees no GPU", version.value, release)
    total = _total_memory(cuda)
    return DriverProbe(True, "", version.value, release, count.value, total)


def gpu_present(load: Loader = ctypes.CDLL) -> bool:
    """True when a driver new enough for this build loads and sees a device."""
    return probe_driver(load).usable


def _total_memory(cuda: Any) -> int:
    """Device 0's memory in bytes, or 0 when the driver does not say."""
    device, total = ctypes.c_int(0), ctypes.c_size_t(0)
    try:
        if cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
            return 0
        if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0:
            return 0
    except AttributeError:
        return 0
    return int(total.value)


@dataclass(frozen=True)
class CudaOptions:
    """What the CUDA provider is told; the settings behind each field say why."""

    use_tf32: bool = False
    gpu_mem_limit_bytes: int = 0  # per session arena; 0 = ONNX Runtime's default (no limit)
    device_id: int = 0

    def provider_options(self) -> dict[str, str]:
        """ONNX Runtime's string options for CUDAExecutionProvider."""
        options = {
            "device_id": str(self.device_id),
            # TF32 is on by default in the provider (cuda_provider_options.h: use_tf32 = 1):
            # float32 products with a 10-bit mantissa, ~1e-3 relative instead of ~1e-6.
            "use_tf32": "1" if self.use_tf32 else "0",
            # Grow the arena by what is asked, not to the next power of two: a 32 x 512 batch
            # must not reserve twice its size for good.
            "arena_extend_strategy": "kSameAsRequested",
        }
        if self.gpu_mem_limit_bytes > 0:
            options["gpu_mem_limit"] = str(self.gpu_mem_limit_bytes)
        return options


def arena_limit_bytes(total_memory_bytes: int, fraction: float, sessions: int) -> int:
    """Each session's arena bound: fraction of the device's memory shared evenly by every
    session this server creates (2 or 3 graphs per version, every version loaded)."""
    if total_memory_bytes <= 0 or fraction <= 0:
        return 0
    return int(total_memory_bytes * fraction) // max(1, sessions)


def cuda_options_for(
    providers: list[str],
    *,
    tf32: bool,
    memory_fraction: float,
    sessions: int,
    probe: Callable[[], DriverProbe] = probe_driver,
) -> CudaOptions | None:
    """The CUDA provider's options for this server, or None when CUDA is not in use."""
    if CUDA not in providers:
        return None
    limit = arena_limit_bytes(probe().total_memory_bytes, memory_fraction, sessions)
    return CudaOptions(use_tf32=tf32, gpu_mem_limit_bytes=limit)


def choose_providers(preference: str, probe: Callable[[], DriverProbe] = probe_driver) -> list[str]:
    """[CUDA, CPU] when asked for cuda (CudaUnavailable if it cannot be had) or when auto finds
    it usable; else [CPU]. CPU stays listed for the few ops CUDA has no kernel for."""
    if preference == "cpu":
        return [CPU]
    if CUDA not in ort.get_available_providers():
        if preference == "cuda":
            raise CudaUnavailable(
                f"--provider cuda: this onnxruntime build ({ort.__version__}) has no CUDA "
                "provider; install onnxruntime-gpu"
            )
        return [CPU]
    found = probe()
    if not found.usable:
        if preference == "cuda":
            raise CudaUnavailable(f"--provider cuda: {found.reason}")
        # A driver that loads but is too old is worth a warning: there is a GPU going unused.
        level = logging.WARNING if found.driver_cuda_version else logging.INFO
        log.log(level, "provider auto: CPU, because %s", found.reason)
        return [CPU]
    log.info("CUDA usable: %s", found.describe())
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA/cuDNN/cuBLAS from the nvidia-* wheels, when installed
    return [CUDA, CPU]


def intra_op_threads_for(requested: int, providers: list[str]) -> int:
    """0 (the default) means all cores on CPU; under CUDA the CPU pool only launches kernels
    and copies, and one thread is the usual best, so 0 becomes 1 there."""
    if requested == 0 and CUDA in providers:
        return 1
    return requested
