"""The worker's status page: how full its queue is and the queue's bounds, in one page of
shared memory beside the worker's socket, which every front end and gateway reads without a
message. A request the queue cannot take is refused at the edge, before its tensor is copied
into a slab or the worker is asked, with the worker's own rule and words; the worker stays
the authority and still refuses what slipped through between two updates.

The page is a seqlock: the worker makes SEQUENCE odd, writes the fields, makes it even
again; a reader retries while SEQUENCE is odd or changed under it. The Go gateway reads the
same layout (service/gateway/contract_gen.go is generated from this module).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

PAGE_NAME = "worker-status"
PAGE_BYTES = 4096
# Little-endian unsigned 64-bit fields at these byte offsets.
SEQUENCE_OFFSET = 0
PENDING_REQUESTS_OFFSET = 8
PENDING_BYTES_OFFSET = 16
MAX_QUEUE_SIZE_OFFSET = 24
MAX_QUEUE_BYTES_OFFSET = 32
_U64 = struct.Struct("<Q")
_FIELDS = struct.Struct("<QQQQ")  # from PENDING_REQUESTS_OFFSET on
READ_TRIES = 64  # a torn read is retried; a worker stuck mid-write is not waited for

# The refusals, word for word the same from the worker, a Python front end and a gateway.
QUEUE_FULL_BY_COUNT = (
    "queue full: {pending} requests waiting (max_queue_size={max_queue_size}); retry with backoff"
)
QUEUE_FULL_BY_BYTES = (
    "queue full: {pending_bytes} bytes waiting, this request adds {nbytes} "
    "(max_queue_bytes={max_queue_bytes}); retry with backoff"
)


def page_path(run_dir: Path) -> Path:
    return run_dir / PAGE_NAME


@dataclass(frozen=True)
class QueueFill:
    """What the queue holds and may hold."""

    pending: int
    pending_bytes: int
    max_queue_size: int
    max_queue_bytes: int

    def refusal(self, nbytes: int, unread: int = 0, unread_bytes: int = 0) -> str | None:
        """Why a request of nbytes of embeddings cannot be queued now; None if it can. An
        empty queue takes any legal request, so no request is refused forever. A front end
        adds what it sent that the worker has not read yet (unread requests and bytes): they
        reach the queue before this one. The numbers shown are what the queue can hold: of
        the unread requests, the worker refuses those past its bounds."""
        pending, pending_bytes = self.pending + unread, self.pending_bytes + unread_bytes
        if pending >= self.max_queue_size:
            return QUEUE_FULL_BY_COUNT.format(
                pending=self.max_queue_size, max_queue_size=self.max_queue_size
            )
        if pending and pending_bytes + nbytes > self.max_queue_bytes:
            shown = max(self.pending_bytes, min(pending_bytes, self.max_queue_bytes))
            if self.pending == 0 and unread == 1:  # an empty queue takes one of any size
                shown = pending_bytes
            return QUEUE_FULL_BY_BYTES.format(
                pending_bytes=shown,
                nbytes=nbytes,
                max_queue_bytes=self.max_queue_bytes,
            )
        return None


def _map(path: Path, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create and os.fstat(fd).st_size < PAGE_BYTES:
            os.ftruncate(fd, PAGE_BYTES)
        return mmap.mmap(fd, PAGE_BYTES)
    finally:
        os.close(fd)  # the mapping keeps the page


class StatusPage:
    """The worker's side: publish() after every change of the queue's fill. The file is made
    once and kept (a restarted worker writes the same page), so readers' mappings stay
    valid."""

    def __init__(self, path: Path, *, max_queue_size: int, max_queue_bytes: int) -> None:
        self._map = _map(path, create=True)
        self._sequence = _U64.unpack_from(self._map, SEQUENCE_OFFSET)[0] & ~1
        self._bounds = (max_queue_size, max_queue_bytes)
        self.publish(0, 0)

    def publish(self, pending: int, pending_bytes: int) -> None:
        self._sequence += 1  # odd: being written
        _U64.pack_into(self._map, SEQUENCE_OFFSET, self._sequence)
        _FIELDS.pack_into(self._map, PENDING_REQUESTS_OFFSET, pending, pending_bytes, *self._bounds)
        self._sequence += 1
        _U64.pack_into(self._map, SEQUENCE_OFFSET, self._sequence)

    def close(self) -> None:
        self._map.close()


class StatusView:
    """A front end's side: the queue's fill as last published (None before the first
    publication, or while the page cannot be read)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._map: mmap.mmap | None = None

    def fill(self) -> QueueFill | None:
        if self._map is None:
            try:
                self._map = _map(self._path, create=False)
            except (OSError, ValueError):  # not made yet: the worker is starting
                return None
        page = self._map
        for _ in range(READ_TRIES):
            before = _U64.unpack_from(page, SEQUENCE_OFFSET)[0]
            if before == 0:
                return None  # never published
            if before & 1:
                continue
            fields = _FIELDS.unpack_from(page, PENDING_REQUESTS_OFFSET)
            if _U64.unpack_from(page, SEQUENCE_OFFSET)[0] == before:
                return QueueFill(*fields)
        return None

    def refusal(self, nbytes: int, unread: int = 0, unread_bytes: int = 0) -> str | None:
        """Why the worker would refuse a request of nbytes now, by the page and what is on
        its way (QueueFill.refusal); None if it would take it (or the page says nothing yet)."""
        fill = self.fill()
        return None if fill is None else fill.refusal(nbytes, unread, unread_bytes)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
