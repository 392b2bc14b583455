"""Client shared-memory regions (Triton's system shared-memory extension), held by the worker.

A client on the same host puts a tensor in a POSIX shared-memory object (/dev/shm/<key>),
registers a region of it by name (through any front end: they relay the call here), and
sends references (region, offset, byte size) instead of bytes. The worker reads an input
with one pread() into its own memory and writes an answer with one pwrite() where the batch
computes it. Nothing is mapped: a client that shrinks or removes its object while a request
uses it makes that request fail (a short read, a check before the write), where a mapping
would have killed the process with SIGBUS.

Keys name objects directly under /dev/shm and nothing else: one name component (with the
optional leading "/" of shm_open's names), opened with O_NOFOLLOW|O_NONBLOCK, refused unless a
regular file that holds the whole region. Regions are bounded in number and total bytes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from service.dataplane import MAX_REGION_NAME_CHARS, RegionRef, region_not_found
from service.errors import InvalidInput, RegionExists, RegionNotFound, RegionsExhausted
from service.text import shown

log = logging.getLogger(__name__)
SHM_ROOT = Path("/dev/shm")
KEY = re.compile(r"/?([A-Za-z0-9_.+-]{1,255})")


def object_path(key: str) -> Path:
    """The /dev/shm path a key names; InvalidInput for anything but one plain name."""
    match = KEY.fullmatch(key) if len(key) <= MAX_REGION_NAME_CHARS + 1 else None
    if match is None or match[1] in (".", ".."):
        raise InvalidInput(
            f"shared-memory key {shown(key)} is not a POSIX shared-memory name; expected one "
            f"name of at most {MAX_REGION_NAME_CHARS} letters, digits or . _ + - (optionally after "
            "one leading '/'), naming an object directly under /dev/shm"
        )
    return SHM_ROOT / match[1]


NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


@dataclass(eq=False)
class ClientRegion:
    """One registered region: bytes [offset, offset + byte_size) of its object.

    The descriptor stays open while a request that will read or write here holds the region
    (users), also after an unregister, so a descriptor number is never reused under a read or
    a write. It is closed exactly once, on the event loop, by whichever of close() and the last
    release() comes second. Writes run on the compute thread under write_lock; unregister takes
    it too (stop_writes), so once it returns nothing more is written here."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    unregistered: bool = False  # set on the event loop only
    writes_stopped: bool = False  # set under write_lock, on a thread
    users: int = 0  # event loop only
    fd_closed: bool = False  # event loop only
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    def check_alive(self) -> None:
        """RegionNotFound if the region was unregistered or its object removed or shrunk."""
        if self.unregistered or self.writes_stopped:
            raise RegionNotFound(f"shared-memory region {shown(self.name)} was unregistered")
        info = os.fstat(self.fd)
        if info.st_nlink == 0 or info.st_size < self.offset + self.byte_size:
            raise RegionNotFound(
                f"the object of shared-memory region {shown(self.name)} (key {shown(self.key)}) "
                "was removed or shrunk; register the region again"
            )

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of the region (bounds checked by the caller), copied
        into this process's memory."""
        self.check_alive()
        data = np.empty(nbytes, np.uint8)
        if os.preadv(self.fd, [data.data], self.offset + offset) != nbytes:
            raise RegionNotFound(
                f"the object of shared-memory region {shown(self.name)} shrank while it was "
                "read; register the region again"
            )
        return data

    def write(self, offset: int, data: np.ndarray) -> None:
        """data's bytes at offset in the region (bounds checked by the caller), all of them:
        RegionsExhausted where /dev/shm has no room left for them."""
        view = data.reshape(-1).view(np.uint8).data
        with self.write_lock:
            self.check_alive()
            at, done = self.offset + offset, 0
            try:
                while done < len(view):
                    written = os.pwritev(self.fd, [view[done:]], at + done)
                    if written == 0:
                        raise OSError(errno.ENOSPC, "no progress")
                    done += written
            except OSError as err:
                if err.errno not in NO_SPACE:
                    raise
                raise RegionsExhausted(
                    f"no space left in /dev/shm for the answer in shared-memory region "
                    f"{shown(self.name)} ({done} of {len(view)} bytes written): the object's "
                    "pages are taken when first written; make /dev/shm larger, or write the "
                    "region's pages once before registering it"
                ) from None

    def retain(self) -> None:
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        self._close_fd_if_unused()

    def stop_writes(self) -> None:
        """Refuse every later write, once one under way has ended (blocks until then: called
        on a thread). Closes nothing: the descriptor is the event loop's to close."""
        with self.write_lock:
            self.writes_stopped = True

    def close(self) -> None:
        """Unregistered (after stop_writes): the descriptor closes once no request holds the
        region."""
        self.unregistered = True
        self._close_fd_if_unused()

    def _close_fd_if_unused(self) -> None:
        if self.unregistered and self.users == 0 and not self.fd_closed:
            self.fd_closed = True
            os.close(self.fd)


class RegionWriter:
    """Writes one answer into a client's region, on the compute thread. Never raises: a region
    gone, shrunk or out of room is kept in error and fails that request alone."""

    def __init__(self, region: ClientRegion, offset: int, nbytes: int, dtype: np.dtype) -> None:
        self._region = region
        self._offset = offset
        self._nbytes = nbytes
        self._dtype = dtype
        self.error: Exception | None = None
        region.retain()

    def write(self, part: np.ndarray) -> None:
        try:
            data = np.ascontiguousarray(part, dtype=self._dtype)
            if data.nbytes > self._nbytes:  # checked before compute; never past the reference
                raise InvalidInput(
                    f"the answer needs {data.nbytes} bytes; the reference holds {self._nbytes}"
                )
            self._region.write(self._offset, data)
        except (InvalidInput, RegionNotFound, RegionsExhausted) as err:
            self.error = err
        except OSError as err:
            log.error(
                "writing an answer into shared-memory region %r failed: %s", self._region.name, err
            )
            self.error = err

    def close(self) -> None:
        """On the event loop, once the request is answered."""
        self._region.release()


def _open(name: str, key: str, offset: int, byte_size: int) -> ClientRegion:
    path = object_path(key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInput(
            f"shared-memory key {shown(key)}: no object {shown(str(path))}; create it first "
            "(tritonclient.utils.shared_memory.create_shared_memory_region)"
        ) from None
    except OSError as err:
        raise InvalidInput(
            f"shared-memory key {shown(key)}: cannot open it read-write ({err.strerror}); "
            "it must be a shared-memory object this server's user may read and write"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(f"shared-memory key {shown(key)} is not a shared-memory object")
        if offset + byte_size > info.st_size:
            raise InvalidInput(
                f"shared-memory region {shown(name)}: offset {offset} + byte_size {byte_size} "
                f"is past the end of object {shown(key)} ({info.st_size} bytes)"
            )
    except BaseException:
        os.close(fd)
        raise
    return ClientRegion(name, key, offset, byte_size, fd)


class ClientRegions:
    """The server's registered regions, used on the worker's event loop only (no lock)."""

    def __init__(self, *, max_regions: int, max_bytes: int) -> None:
        self._regions: dict[str, ClientRegion] = {}
        self._max_regions = max_regions
        self._max_bytes = max_bytes

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name or len(name) > MAX_REGION_NAME_CHARS:
            raise InvalidInput(
                f"shared-memory region name {shown(name)} must be 1..{MAX_REGION_NAME_CHARS} "
                "characters"
            )
        if name in self._regions:
            raise RegionExists(
                f"shared-memory region {shown(name)} is registered already; unregister it first"
            )
        if byte_size <= 0:
            raise InvalidInput(f"shared-memory region {shown(name)}: byte_size must be > 0")
        if offset < 0:
            raise InvalidInput(f"shared-memory region {shown(name)}: offset must be >= 0")
        region = _open(name, key, offset, byte_size)  # the object must hold the region
        used = sum(each.byte_size for each in self._regions.values())
        if len(self._regions) >= self._max_regions:
            region.close()
            raise RegionsExhausted(
                f"{len(self._regions)} shared-memory regions are registered, this server's "
                f"limit (--max-client-shared-memory-regions); unregister one first"
            )
        if used + byte_size > self._max_bytes:
            region.close()
            raise RegionsExhausted(
                f"registering {byte_size} bytes would make {used + byte_size} bytes of "
                f"shared-memory regions, above this server's {self._max_bytes} "
                "(--max-client-shared-memory-bytes); unregister some first"
            )
        self._regions[name] = region

    async def unregister(self, name: str) -> None:
        """Unregister one region (none of that name: nothing to do), or every one (""). Once
        this returns, nothing more is written into them."""
        names = [name] if name else list(self._regions)
        gone = [region for each in names if (region := self._regions.pop(each, None))]
        for region in gone:
            await asyncio.to_thread(region.stop_writes)  # a write may be under way
            region.close()

    def get(self, name: str) -> ClientRegion:
        region = self._regions.get(name)
        if region is None:
            raise region_not_found(name)
        return region

    def checked(self, ref: RegionRef) -> ClientRegion:
        """The region a reference names, once the reference lies inside it."""
        region = self.get(ref.region)
        if ref.offset + ref.byte_size > region.byte_size:
            raise InvalidInput(
                f"{ref.where}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                f"{ref.byte_size} is past the end of shared-memory region {shown(region.name)} "
                f"({region.byte_size} bytes)"
            )
        return region

    def status(self, name: str) -> list[ClientRegion]:
        """One region (RegionNotFound if unknown), or every one ("")."""
        return [self.get(name)] if name else list(self._regions.values())

    def close(self) -> None:
        """The worker stops (nothing computes any more)."""
        for region in self._regions.values():
            region.close()
        self._regions.clear()
