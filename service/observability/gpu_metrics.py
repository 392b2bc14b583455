"""GPU utilization, memory and power from NVML (nvidia-ml-py, `import pynvml`), as Triton's
nv_gpu_* series give them, read by the supervisor at each scrape.

Without the package, without NVIDIA's driver library or without a GPU there are no GPU series
at all (and no error): the same server runs on CPU-only machines."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.observability.metrics import PREFIX

log = logging.getLogger(__name__)
LABELS = ["gpu", "gpu_uuid"]  # NVML's index, and the UUID Triton labels its series with


@dataclass(frozen=True)
class _Device:
    index: str
    uuid: str
    handle: Any


def _load_nvml() -> Any:
    import pynvml

    return pynvml


class GpuCollector(Collector):
    """attention_gpu_* of every GPU NVML shows this process; nothing when there is none."""

    def __init__(self, load: Callable[[], Any] = _load_nvml) -> None:
        self._nvml: Any = None
        self._devices: list[_Device] = []
        try:
            nvml = load()
        except ImportError:
            log.debug("no GPU metrics: nvidia-ml-py is not installed")
            return
        try:
            nvml.nvmlInit()
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                self._devices.append(_Device(str(index), uuid, handle))
        except nvml.NVMLError as err:  # no driver library, no GPU, or no permission
            log.debug("no GPU metrics: NVML: %s", err)
            self._devices = []
            return
        self._nvml = nvml
        if self._devices:
            log.info("GPU metrics for %d GPU(s) from NVML", len(self._devices))

    def describe(self) -> Iterator[Metric]:
        """The families a GPU would show (for tools that check names, with or without one)."""
        return iter(_families().values())

    def collect(self) -> Iterator[Metric]:
        if not self._devices:
            return
        families = _families()
        for device in self._devices:
            for name, value in self._read(device):
                families[name].add_metric([device.index, device.uuid], value)
        yield from families.values()

    def _read(self, device: _Device) -> Iterator[tuple[str, float]]:
        """Each quantity this GPU reports; one it does not support (power on some boards) or
        that fails just now is left out, the others still come."""
        nvml, handle = self._nvml, device.handle
        readings: dict[str, Callable[[], float]] = {
            "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            "memory_used": lambda: float(nvml.nvmlDeviceGetMemoryInfo(handle).used),
            "memory_total": lambda: float(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            "power_usage": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW
            "power_limit": lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
            "energy": lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0,  # mJ
        }
        for name, read in readings.items():
            try:
                yield name, read()
            except nvml.NVMLError:
                continue


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    gpu = f"{PREFIX}_gpu"
    return {
        "utilization": GaugeMetricFamily(
            f"{gpu}_utilization_ratio",
            "Fraction of the last sample period (1/6 s to 1 s, by GPU) during which a kernel "
            "ran on the GPU (NVML; Triton's nv_gpu_utilization).",
            labels=LABELS,
        ),
        "memory_used": GaugeMetricFamily(
            f"{gpu}_memory_used_bytes",
            "GPU memory in use, by every process on the GPU (NVML; Triton's "
            "nv_gpu_memory_used_bytes).",
            labels=LABELS,
        ),
        "memory_total": GaugeMetricFamily(
            f"{gpu}_memory_total_bytes",
            "GPU memory in all (NVML; Triton's nv_gpu_memory_total_bytes).",
            labels=LABELS,
        ),
        "power_usage": GaugeMetricFamily(
            f"{gpu}_power_usage_watts",
            "Power the GPU draws now (NVML; Triton's nv_gpu_power_usage).",
            labels=LABELS,
        ),
        "power_limit": GaugeMetricFamily(
            f"{gpu}_power_limit_watts",
            "Power limit the GPU enforces (NVML; Triton's nv_gpu_power_limit).",
            labels=LABELS,
        ),
        "energy": CounterMetricFamily(
            f"{gpu}_energy_consumption_joules",
            "Energy the GPU used since its driver loaded (NVML; Triton's nv_energy_consumption).",
            labels=LABELS,
        ),
    }
