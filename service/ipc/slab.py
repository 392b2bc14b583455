"""A shared-memory slab: one memfd that a front end creates and the worker maps too.

memfd rather than a POSIX name under /dev/shm: it has no name to leak when a process is
killed (the memory goes when the last mapping does), and it does not count against a
container's /dev/shm size (64 MiB by default under Docker), only against its memory limit.
Pages are taken when first written, so a large slab costs nothing until it is used; large
regions give their pages back when freed.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.errors import QueueFull
from service.status_texts import SLAB_FULL, SLAB_TOO_SMALL

log = logging.getLogger(__name__)
ALIGN = 64  # cache-line aligned regions: numpy and ONNX Runtime read them at full speed
PAGE = mmap.PAGESIZE
# Freed regions this large give their pages back to the kernel (a weights answer at seq 512
# is 8 MiB a sequence); smaller ones stay resident for the next request to reuse, until the
# link has been idle a moment (every page goes back then). Mapped afresh, a region faults
# every page in again: at 1 MiB, requests of [4, 128, 512] (1 MiB each way) cost the
# gateway 3.4-3.6 ms a call, at 8 MiB 1.7-1.8 ms (pinned, h2load, 8 streams).
RELEASE_BYTES = 8 << 20
# The slab's first bytes are the worker's: how many INFER requests, and how many bytes of
# their embeddings, it has read from this front end's link so far (little-endian unsigned
# 64-bit counters, written by the worker after each read). With what it has sent, a front
# end knows what is still on its way to the worker's queue, which the worker's status page
# cannot show; refusing at the edge counts it. Tensors start after them.
HEADER_BYTES = ALIGN
READ_REQUESTS_OFFSET = 0
READ_BYTES_OFFSET = 8
_REQUESTS, _BYTES = READ_REQUESTS_OFFSET // 8, READ_BYTES_OFFSET // 8  # their 64-bit words


@functools.lru_cache(maxsize=16)
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def embedding_bytes(shape: Sequence[int], dtype: str) -> int:
    """What one request's embeddings count in the read counters: its shape's elements times
    its dtype's size (numpy's name), the same on both ends of a link."""
    return math.prod(shape) * _itemsize(dtype)


class SlabTooSmall(QueueFull):
    """A request whose tensors would not fit even an empty slab: never retryable as is."""


class SlabFull(QueueFull):
    """The front end's shared memory holds as many tensors as it may; retry with backoff."""


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int


def _aligned(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


class Slab:
    """A mapping of one memfd. create() makes a new one (the front end); attach() maps the
    descriptor another process sent (the worker)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size)
        # The header's counters as aligned 64-bit words: numpy stores and loads each with one
        # instruction, where struct packs byte by byte and a reader could see half a store.
        self._read_counts = np.ndarray((2,), dtype="<u8", buffer=self._map, offset=0)

    @classmethod
    def create(cls, capacity: int, name: str) -> Slab:
        """A slab with capacity bytes for tensors, after its header."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            return cls(fd, HEADER_BYTES + capacity)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> Slab:
        return cls(fd, os.fstat(fd).st_size)

    @property
    def capacity(self) -> int:
        """Bytes for tensors: all but the header."""
        return self.size - HEADER_BYTES

    def note_read(self, requests: int, nbytes: int) -> None:
        """The worker: requests (and embedding bytes) read from this link so far."""
        self._read_counts[_REQUESTS] = requests
        self._read_counts[_BYTES] = nbytes

    def read_counts(self) -> tuple[int, int]:
        """The front end: what the worker has read so far (requests, embedding bytes), as two
        reads that agree (a read racing the worker's write is taken again)."""
        counts = self._read_counts
        while True:
            first = (int(counts[_REQUESTS]), int(counts[_BYTES]))
            if (int(counts[_REQUESTS]), int(counts[_BYTES])) == first:
                return first

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A numpy view of part of the slab (no copy)."""
        return np.ndarray(shape, dtype=dtype, buffer=self._map, offset=offset)

    def release_pages(self, region: Region) -> None:
        """Give the whole pages inside region back to the kernel (they read as zeros after)."""
        start = (region.offset + PAGE - 1) // PAGE * PAGE
        end = (region.offset + region.nbytes) // PAGE * PAGE
        if end > start:
            self._map.madvise(mmap.MADV_REMOVE, start, end - start)

    def close(self) -> None:
        """Close the descriptor; the mapping goes when the last view of it does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RegionAllocator:
    """First fit over a sorted free list, coalescing on free, over size bytes from base (a
    slab's tensors start after its header). Used by the front end alone, on its event loop
    (no lock)."""

    def __init__(self, size: int, base: int = HEADER_BYTES) -> None:
        self.size = size
        self._starts: list[int] = [base]  # free blocks, sorted by start
        self._lengths: dict[int, int] = {base: size}
        self._taken: dict[int, int] = {}  # start -> length of each region handed out
        self.used = 0

    def alloc(self, nbytes: int) -> Region:
        need = _aligned(nbytes)
        if need > self.size:
            raise SlabTooSmall(SLAB_TOO_SMALL.format(need=need, size=self.size))
        for start in self._starts:
            length = self._lengths[start]
            if length >= need:
                self._take(start, length, need)
                self.used += need
                self._taken[start] = need
                return Region(start, need)
        raise SlabFull(SLAB_FULL.format(used=self.used, size=self.size, need=need))

    def _take(self, start: int, length: int, need: int) -> None:
        index = bisect.bisect_left(self._starts, start)
        del self._starts[index]
        del self._lengths[start]
        if length > need:
            rest = start + need
            self._starts.insert(index, rest)
            self._lengths[rest] = length - need

    def free(self, region: Region) -> None:
        start, length = region.offset, region.nbytes
        if self._taken.get(start) != length:
            # Freeing twice would hand one region to two requests: refuse, loudly.
            log.error("shared-memory region %s freed but not held; ignored", region)
            return
        del self._taken[start]
        self.used -= length
        index = bisect.bisect_left(self._starts, start)
        # Merge with the following block, then with the preceding one.
        if index < len(self._starts) and self._starts[index] == start + length:
            length += self._lengths.pop(self._starts.pop(index))
        if index > 0:
            before = self._starts[index - 1]
            if before + self._lengths[before] == start:
                self._lengths[before] += length
                return
        self._starts.insert(index, start)
        self._lengths[start] = length

    def free_bytes(self) -> int:
        return self.size - self.used

    def free_blocks(self) -> list[Region]:
        """The free blocks, lowest first (coalesced: none touches the next)."""
        return [Region(start, self._lengths[start]) for start in self._starts]
