"""How much memory this process may use, and the queue's share of it.

The queue is bounded by bytes as well as by count: a queued maximum-size request costs about
three times its embeddings (gRPC's receive buffer, the parsed message, the cast or batch
copy), and twenty of them exceeded the 4 GiB limit of the Kubernetes manifests. The default
byte bound gives queued requests a quarter of the memory the process may use, counted at
three times their payload; the rest is left for the model, the batch computing now and its
answers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2 (Kubernetes, docker, podman)
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)
QUEUE_SHARE = 0.25
COST_PER_PAYLOAD_BYTE = 3


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit_bytes(limit_files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int:
    """The container's memory limit, or the machine's memory where there is none."""
    physical = physical_memory_bytes()
    for path in limit_files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isascii() and text.isdigit():  # "max" (v2) means no limit
            return min(int(text), physical)  # v1 reports "no limit" as a huge number
    return physical


def default_queue_bytes(limit_bytes: int) -> int:
    """Embeddings bytes the queue may hold by default, out of limit_bytes of memory."""
    return int(limit_bytes * QUEUE_SHARE / COST_PER_PAYLOAD_BYTE)


# A batch this large (its padded input; intermediates are several times more) leaves enough
# freed memory scattered over malloc's per-thread arenas that resident memory would creep up
# burst after burst; handing it back costs one pass over the heap, small beside such a batch.
TRIM_AFTER_BATCH_BYTES = 8 << 20
# A process idle this long after such memory churned gives malloc's free pages back: soon
# enough for a dashboard to see the burst's memory go, late enough that steady traffic with
# gaps between calls keeps its buffers.
IDLE_TRIM_AFTER_S = 0.5


def batch_memory_bytes(embeddings_bytes: int, with_weights: bool) -> int:
    """What a batch's memory is counted as against TRIM_AFTER_BATCH_BYTES: its input, or four
    times it with weights (the weights output and their intermediates take several times the
    input)."""
    return embeddings_bytes * 4 if with_weights else embeddings_bytes


def is_large_batch(
    embeddings: np.ndarray, with_weights: bool, weights: np.ndarray | None = None
) -> bool:
    """Whether a batch is large enough to give its memory back once it ends (a weights
    output given, h x t / d times the input, counts by its own size too)."""
    if weights is not None and weights.nbytes >= TRIM_AFTER_BATCH_BYTES:
        return True
    return batch_memory_bytes(embeddings.nbytes, with_weights) >= TRIM_AFTER_BATCH_BYTES


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "malloc_trim", None)


def release_free_memory() -> bool:
    """Give malloc's free pages back to the kernel (glibc); False where that is not possible."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
