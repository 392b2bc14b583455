"""Every process's series, read from the multiprocess folder as a scrape finds it.

prometheus-client's MultiProcessCollector fails the whole scrape (a 500 from /metrics) when
a file it listed is gone when it reads it (a child that died during the scrape: its live
gauges' files are removed) or holds nothing yet (a child that started during it: its file
is made empty, then sized). Read again a moment later, such a scrape succeeds; a file that
stays unreadable (a process killed while making it) is left out, not the scrape."""

from __future__ import annotations

import glob
import os
import struct
import time
from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

READS = 3  # of the whole folder, before a file that fails is left out
REREAD_AFTER_S = 0.01


class ProcessFiles(Collector):
    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self) -> Iterable[Metric]:
        for _ in range(READS):
            try:
                return MultiProcessCollector.merge(self._files(), accumulate=True)
            except (OSError, struct.error):
                time.sleep(REREAD_AFTER_S)
        return MultiProcessCollector.merge(
            [path for path in self._files() if _readable(path)], accumulate=True
        )

    def _files(self) -> list[str]:
        return glob.glob(os.path.join(self._path, "*.db"))


def _readable(path: str) -> bool:
    try:
        MmapedDict.read_all_values_from_file(path)
    except (OSError, struct.error):
        return False
    return True
