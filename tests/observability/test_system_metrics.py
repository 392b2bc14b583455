"""The supervisor's collectors of process and GPU metrics: /proc of real processes, and a fake
NVML module standing in for nvidia-ml-py (the GPU series on a real GPU: bench/gpu.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from bench.harness import Samples, parse_samples
from service.observability.gpu_metrics import GpuCollector
from service.observability.process_metrics import ProcessCollector, read_stat
from tests.harness.server_process import rss_bytes


def _samples(collector: Any) -> Samples:
    """What a scrape of a registry holding collector shows (through the exposition format)."""
    registry = CollectorRegistry()
    registry.register(collector)
    return parse_samples(generate_latest(registry).decode())


def test_cpu_and_memory_of_each_process_by_role() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # its interpreter is up: sampled earlier, it is still exec'ing
        pids = {"supervisor": os.getpid(), "worker": child.pid, "gateway-0": 2**22 + 7}
        samples = _samples(ProcessCollector(lambda: pids))
    finally:
        child.communicate(b"")
    cpu = {
        dict(labels)["process"]: value
        for (name, labels), value in samples.items()
        if name == "attention_process_cpu_seconds_total"
    }
    memory = {
        dict(labels)["process"]: value
        for (name, labels), value in samples.items()
        if name == "attention_process_resident_memory_bytes"
    }
    assert set(cpu) == set(memory) == {"supervisor", "worker"}  # a gone pid has no series
    own_cpu = os.times()
    assert 0 < cpu["supervisor"] <= own_cpu.user + own_cpu.system + 0.02
    assert 0.5 < memory["supervisor"] / rss_bytes(os.getpid()) < 2
    assert memory["worker"] > 1 << 20


def test_cpu_seconds_move_when_the_process_works() -> None:
    read = read_stat(os.getpid())
    assert read is not None
    before = read[0]
    total = 0
    while (after := read_stat(os.getpid())) is not None and after[0] <= before:
        total += sum(range(10_000))  # 10 ms of CPU is the kernel's tick
    assert after is not None
    assert after[0] > before


def test_a_zombie_has_no_series() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    try:
        assert read_stat(child.pid) is None
    finally:
        child.wait()


# -- GPU ----------------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_nvml(devices: list[dict[str, Any]], *, init_error: bool = False) -> types.ModuleType:
    """A module with the pynvml calls the collector makes, answering for devices."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError  # type: ignore[attr-defined]

    def init() -> None:
        if init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def reading(name: str, wrap: Callable[[Any], Any] = lambda value: value) -> Any:
        def read(handle: int) -> Any:
            value = devices[handle].get(name)
            if value is None:
                raise FakeNVMLError("Not Supported")
            return wrap(value)

        return read

    namespace = types.SimpleNamespace
    functions = {
        "nvmlInit": init,
        "nvmlDeviceGetCount": lambda: len(devices),
        "nvmlDeviceGetHandleByIndex": lambda index: index,
        "nvmlDeviceGetUUID": reading("uuid"),
        "nvmlDeviceGetUtilizationRates": reading("gpu", lambda v: namespace(gpu=v, memory=0)),
        "nvmlDeviceGetMemoryInfo": reading("memory", lambda v: namespace(used=v[0], total=v[1])),
        "nvmlDeviceGetPowerUsage": reading("milliwatts"),
        "nvmlDeviceGetEnforcedPowerLimit": reading("limit_milliwatts"),
        "nvmlDeviceGetTotalEnergyConsumption": reading("millijoules"),
    }
    for name, function in functions.items():
        setattr(nvml, name, function)
    return nvml


H200 = {
    "uuid": b"GPU-5e3d",
    "gpu": 37,
    "memory": (2 << 30, 141 << 30),
    "milliwatts": 118_500,
    "limit_milliwatts": 700_000,
    "millijoules": 9_876_543,
}


def test_gpu_series_from_nvml() -> None:
    # The second board reports no power (NVML: Not Supported): its other series still come.
    other = {**H200, "uuid": "GPU-77aa", "gpu": 0, "milliwatts": None}
    samples = _samples(GpuCollector(lambda: fake_nvml([H200, other])))
    first = (("gpu", "0"), ("gpu_uuid", "GPU-5e3d"))
    second = (("gpu", "1"), ("gpu_uuid", "GPU-77aa"))
    assert samples[("attention_gpu_utilization_ratio", first)] == 0.37
    assert samples[("attention_gpu_memory_used_bytes", first)] == 2 << 30
    assert samples[("attention_gpu_memory_total_bytes", first)] == 141 << 30
    assert samples[("attention_gpu_power_usage_watts", first)] == 118.5
    assert samples[("attention_gpu_power_limit_watts", first)] == 700.0
    assert samples[("attention_gpu_energy_consumption_joules_total", first)] == 9876.543
    assert samples[("attention_gpu_utilization_ratio", second)] == 0.0
    assert ("attention_gpu_power_usage_watts", second) not in samples
    assert len(samples) == 6 + 5


def test_no_gpu_series_without_nvml_or_without_a_gpu() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    for load in (missing, lambda: fake_nvml([], init_error=True), lambda: fake_nvml([])):
        assert _samples(GpuCollector(load)) == {}
