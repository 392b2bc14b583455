"""glibc malloc settings for a process that allocates and frees many large tensors.

Each request allocates a few buffers of hundreds of KiB (the request bytes, the response
bytes). glibc gives freed memory back to the kernel as soon as the top of its heap holds
more than ~128 KiB free, so the next request faults every page in again: measured on the
echo server at seq 128, about a third of its CPU per request. Keeping up to
TRIM_THRESHOLD_BYTES of freed heap for reuse removes those faults (glibc trims an arena's free
top past it; the trims after large batches and backlogs hand back the rest). An allocation of
MMAP_THRESHOLD_BYTES or more that the freed heap cannot hold is mmapped and goes straight back
to the kernel when freed, so big tensors neither stay resident nor fragment the heap. The
threshold is the size from which a batch gives its memory back (budget.is_large_batch): the
merged input and output of a smaller batch, a few MiB each at seq 128 (2 MiB for 8
sequences), come from reused heap, where mmapped they would fault every page in again for
every batch (6 % of the worker's CPU per request at seq 128 with 64 callers, pinned, h2load).
glibc applies the trim threshold to each malloc arena (about one per thread that allocates);
capping the arenas was measured to cost half the throughput at seq 16 (the compute thread and
the event loop then contend for one arena's lock), so they are left to glibc. malloc_trim
hands back a thread arena's free chunks but never its free top, so the threshold is what each
thread arena may keep once idle: at 32 MiB the Python front end's gRPC threads settled 90 MiB
higher after eight bursts of large answers (gateway off) and still rose; at 8 MiB, 50 MiB
higher and level, with no change in throughput at seq 16 or 128 through the gateway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from service.memory.budget import TRIM_AFTER_BATCH_BYTES

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD_BYTES = 8 << 20
TOP_PAD_BYTES = 4 << 20
MMAP_THRESHOLD_BYTES = TRIM_AFTER_BATCH_BYTES


def keep_freed_memory() -> bool:
    """Apply the settings above; False (and nothing changed) where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    refused = [param for param, value in settings if mallopt(param, value) != 1]
    if refused:
        log.warning("mallopt refused parameters %s; glibc's defaults stay for those", refused)
    return not refused
