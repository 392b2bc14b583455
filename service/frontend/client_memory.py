"""Client shared-memory regions (Triton's system shared-memory extension), in one front end.

A client on the same host puts a tensor in a POSIX shared-memory object (/dev/shm/<key>),
registers a region of it by name, and sends references (region, offset, byte size) instead of
bytes. The region is mapped here, in the front end, and only its own bytes: a request's input
is copied once from it into the slab the worker reads, and an answer from the slab into it.

Keys name objects directly under /dev/shm and nothing else: one name component (with the
optional leading "/" of shm_open's names), opened with O_NOFOLLOW|O_NONBLOCK, refused unless a
regular file that holds the whole region. Regions are bounded in number and total bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from service.errors import InvalidInput, RegionExists, RegionNotFound, RegionsExhausted
from service.text import shown

SHM_ROOT = Path("/dev/shm")
MAX_NAME_CHARS = 255  # NAME_MAX, for keys and region names alike
KEY = re.compile(r"/?([A-Za-z0-9_.+-]{1,255})")


def object_path(key: str) -> Path:
    """The /dev/shm path a key names; InvalidInput for anything but one plain name."""
    match = KEY.fullmatch(key) if len(key) <= MAX_NAME_CHARS + 1 else None
    if match is None or match[1] in (".", ".."):
        raise InvalidInput(
            f"shared-memory key {shown(key)} is not a POSIX shared-memory name; expected one "
            f"name of at most {MAX_NAME_CHARS} letters, digits or . _ + - (optionally after "
            "one leading '/'), naming an object directly under /dev/shm"
        )
    return SHM_ROOT / match[1]


@dataclass(eq=False)
class ClientRegion:
    """One registered region, mapped: bytes [offset, offset + byte_size) of its object."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    _map: mmap.mmap
    _start: int  # where the region begins inside the mapping (mmap offsets are page-aligned)
    closed: bool = field(default=False)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of the region; the caller has checked the bounds
        and that the object still holds them (check_alive)."""
        start = self._start + offset
        return memoryview(self._map)[start : start + nbytes]

    def check_alive(self) -> None:
        """RegionNotFound if the region was unregistered or its object removed or shrunk
        (reading a truncated mapping would kill the process with SIGBUS)."""
        if self.closed:
            raise RegionNotFound(f"shared-memory region {shown(self.name)} was unregistered")
        info = os.fstat(self.fd)
        if info.st_nlink == 0 or info.st_size < self.offset + self.byte_size:
            raise RegionNotFound(
                f"the object of shared-memory region {shown(self.name)} (key {shown(self.key)}) "
                "was removed or shrunk; register the region again"
            )

    def close(self) -> None:
        self.closed = True
        # A request that read its input from here may still hold a view of it until it returns;
        # then the mapping goes with the last reference.
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)


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
        start = offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, start + byte_size, offset=offset - start)
    except BaseException:
        os.close(fd)
        raise
    return ClientRegion(name, key, offset, byte_size, fd, mapping, start)


class ClientRegions:
    """The front end's registered regions, used on its event loop only (no lock)."""

    def __init__(self, *, max_regions: int, max_bytes: int) -> None:
        self._regions: dict[str, ClientRegion] = {}
        self._max_regions = max_regions
        self._max_bytes = max_bytes

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidInput(
                f"shared-memory region name {shown(name)} must be 1..{MAX_NAME_CHARS} characters"
            )
        if name in self._regions:
            raise RegionExists(
                f"shared-memory region {shown(name)} is registered already; unregister it first"
            )
        if byte_size <= 0:
            raise InvalidInput(f"shared-memory region {shown(name)}: byte_size must be > 0")
        if len(self._regions) >= self._max_regions:
            raise RegionsExhausted(
                f"{len(self._regions)} shared-memory regions are registered, this server's "
                f"limit (--max-client-shared-memory-regions); unregister one first"
            )
        used = sum(region.byte_size for region in self._regions.values())
        if used + byte_size > self._max_bytes:
            raise RegionsExhausted(
                f"registering {byte_size} bytes would make {used + byte_size} bytes of "
                f"shared-memory regions, above this server's {self._max_bytes} "
                "(--max-client-shared-memory-bytes); unregister some first"
            )
        self._regions[name] = _open(name, key, offset, byte_size)

    def unregister(self, name: str) -> None:
        """Unregister one region (none of that name: nothing to do), or every one ("")."""
        names = [name] if name else list(self._regions)
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                region.close()

    def get(self, name: str) -> ClientRegion:
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(
                f"no shared-memory region {shown(name)} is registered; register it first"
            )
        return region

    def status(self, name: str) -> list[ClientRegion]:
        """One region (RegionNotFound if unknown), or every one ("")."""
        return [self.get(name)] if name else list(self._regions.values())

    def close(self) -> None:
        self.unregister("")
