"""CPU time and resident memory of every process of the server, by role, read by the
supervisor from /proc at each scrape.

prometheus-client's multiprocess mode has no process collector, and the gateways are Go
processes: one reader of /proc/PID/stat in the supervisor covers every role alike (worker,
front ends, gateways and itself), costs the processes being measured nothing, and needs no
metric files written by the Go side."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.observability.metrics import PREFIX

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# /proc/PID/stat's fields after the command's closing parenthesis: state is field 3.
UTIME, STIME, RSS = 14 - 3, 15 - 3, 24 - 3


def read_stat(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, user and system, resident bytes) of a live process; None when it is gone
    (or a zombie, killed and not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    cpu_s = (int(fields[UTIME]) + int(fields[STIME])) / TICKS_PER_S
    return cpu_s, int(fields[RSS]) * PAGE_BYTES


class ProcessCollector(Collector):
    """attention_process_cpu_seconds_total and attention_process_resident_memory_bytes of each
    process pids() names (role -> pid); a process that restarts starts its counter anew, as
    a restarted pod's would."""

    def __init__(
        self,
        pids: Callable[[], Mapping[str, int]],
        read: Callable[[int], tuple[float, int] | None] = read_stat,
    ) -> None:
        self._pids = pids
        self._read = read

    def describe(self) -> Iterator[Metric]:
        return iter(_families())

    def collect(self) -> Iterator[Metric]:
        cpu, memory = _families()
        for role, pid in sorted(self._pids().items()):
            read = self._read(pid)
            if read is not None:
                cpu.add_metric([role], read[0])
                memory.add_metric([role], float(read[1]))
        yield cpu
        yield memory


def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily]:
    return (
        CounterMetricFamily(
            f"{PREFIX}_process_cpu_seconds",
            "CPU time (user and system) a process of the server has used since it started, by "
            "process: supervisor, worker, frontend-K, gateway-K.",
            labels=["process"],
        ),
        GaugeMetricFamily(
            f"{PREFIX}_process_resident_memory_bytes",
            "Resident memory of a process of the server (shared memory it has touched "
            "included), by process: supervisor, worker, frontend-K, gateway-K.",
            labels=["process"],
        ),
    )
