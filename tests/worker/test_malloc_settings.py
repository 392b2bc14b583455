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


# A thread's arena: a burst of 1 MiB buffers freed from the top down leaves one free top,
# which only a free() in that arena trims (malloc_trim reaches the main arena's top alone).
THREAD_ARENA = """
import ctypes, ctypes.util, threading

from service.memory.malloc import keep_freed_memory


def rss_anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])


libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert keep_freed_memory()


def burst():
    blocks = [libc.malloc(1 << 20) for _ in range(24)]
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    for block in reversed(blocks):
        libc.free(block)


before = rss_anon_kib()
thread = threading.Thread(target=burst)
thread.start()
thread.join()
libc.malloc_trim(0)
print(rss_anon_kib() - before)
"""


def test_a_thread_arena_keeps_at_most_the_trim_threshold_once_idle() -> None:
    """What each of a process's threads may keep after a burst, trims or no trims: the trim
    threshold and the top pad (8 + 4 MiB). At 32 MiB the Python front end's gRPC threads
    kept 24 MiB here each, and its idle memory rose over bursts of large answers."""
    result = subprocess.run(
        [sys.executable, "-c", THREAD_ARENA], capture_output=True, text=True, timeout=60, check=True
    )
    kept_mib = int(result.stdout) / 1024
    assert kept_mib < 14, f"a thread's arena kept {kept_mib:.1f} MiB after a 24 MiB burst"
