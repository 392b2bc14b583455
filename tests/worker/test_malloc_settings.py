"""--malloc-reuse on: a batch-sized allocation under the mmap threshold comes from the heap
(reused, no fresh pages per batch), one at the threshold is mmapped (handed back when freed).
Checked in a fresh process, whose heap has no freed memory that could hold either."""

from __future__ import annotations

import subprocess
import sys

from service.memory.budget import TRIM_AFTER_BATCH_BYTES
from service.memory.malloc import MMAP_THRESHOLD_BYTES

# mallinfo2's hblks: chunks allocated with mmap right now (glibc 2.33 and later).
PROBE = """
import ctypes, ctypes.util

from service.memory.malloc import MMAP_THRESHOLD_BYTES, keep_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
assert keep_freed_memory()
before = libc.mallinfo2().hblks
below = libc.malloc(2 << 20)  # 2 MiB: 8 sequences of 128 x 512 float32
after_below = libc.mallinfo2().hblks
at = libc.malloc(MMAP_THRESHOLD_BYTES)
after_at = libc.mallinfo2().hblks
print(after_below - before, after_at - after_below)
"""


def test_batches_under_the_threshold_reuse_the_heap_and_larger_ones_are_mmapped() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    mmapped_below, mmapped_at = (int(word) for word in result.stdout.split())
    assert (mmapped_below, mmapped_at) == (0, 1)


def test_the_threshold_is_the_size_from_which_a_batch_gives_its_memory_back() -> None:
    assert MMAP_THRESHOLD_BYTES == TRIM_AFTER_BATCH_BYTES == 8 << 20
