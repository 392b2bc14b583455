"""A child's standard error, relayed through the supervisor into its log lines.

gRPC core and ONNX Runtime write their own lines to file descriptor 2, and a dying process
writes its last words there; raw, they break `--log-format json`'s one object per line. Each
child's descriptor 2 is a FIFO in the run directory that the supervisor reads, logging each
line as a record of that child in the format in force (stray_lines says which logger and
level). The child's own log records skip the FIFO: they go to the original standard error.
A gateway has a FIFO of its own (role gateway-K), for what Go's runtime writes there (a
panic, a goroutine dump); its log lines, too, go to the original standard error. The
supervisor outlives a child that crashes, so what it wrote last is read and logged before
its exit is.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from pathlib import Path

from service.observability import logs, stray_lines
from service.observability.stderr_fifo import fifo_path, open_writer

log = logging.getLogger(__name__)
# What a child may write before it waits for the supervisor to read (the kernel's default
# is 64 KiB; a burst of gRPC core's lines should not hold up a request).
FIFO_BYTES = 1024 * 1024
READ_BYTES = 64 * 1024
# Read per turn of the supervisor's loop, so that a child writing without pause cannot hold
# up its other work; the rest is read on the next turns.
READ_PER_TURN_BYTES = READ_BYTES
# A line not ended within this many bytes is logged as it stands (the relay holds no more).
MAX_LINE_BYTES = 64 * 1024


class StderrRelay:
    """The FIFO one child role writes to (each restart of it too), read on the event loop."""

    def __init__(self, run_dir: Path, role: str, fifo_bytes: int | None = FIFO_BYTES) -> None:
        """fifo_bytes: what the FIFO holds (None: the kernel's default, 64 KiB; enough for a
        writer that writes only as it dies, such as a gateway)."""
        self.role = role
        self.path = fifo_path(run_dir, role)
        os.mkfifo(self.path, 0o600)
        try:
            # Read and write: the relay is a writer itself, so a child's exit is no end of
            # file (which would wake the loop for ever) and the next child opens a FIFO that
            # is being read.
            self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            self.path.unlink()
            raise
        if fifo_bytes is not None:
            with contextlib.suppress(OSError):  # above the system's limit: the default size
                fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, fifo_bytes)
        self._partial = b""
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self.drain)

    def drain(self, limit: int = READ_PER_TURN_BYTES) -> None:
        """Log the whole lines among the next limit bytes the FIFO holds."""
        chunks = [self._partial]
        taken = 0
        while taken < limit:
            try:
                chunk = os.read(self._fd, READ_BYTES)
            except BlockingIOError:
                break
            except OSError as err:  # cannot happen to a FIFO it holds open; never spin on it
                log.error("cannot read %s's standard error any more: %s", self.role, err)
                self._stop_reading()
                break
            if not chunk:
                break
            chunks.append(chunk)
            taken += len(chunk)
        *lines, self._partial = b"".join(chunks).split(b"\n")
        if len(self._partial) > MAX_LINE_BYTES:
            lines.append(self._partial)
            self._partial = b""
        self._log(lines)

    def end(self) -> None:
        """The child exited: log all it wrote, a line it did not end included."""
        self.drain(limit=FIFO_BYTES + READ_BYTES)
        partial, self._partial = self._partial, b""
        self._log([partial])

    def close(self) -> None:
        self.end()
        self._stop_reading()
        os.close(self._fd)
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def _log(self, lines: list[bytes]) -> None:
        for record in stray_lines.records(lines):
            logging.getLogger(record.logger).log(
                record.level, "%s", record.message, extra={logs.RELAYED_FROM: self.role}
            )


def attach(run_dir: Path, role: str) -> int | None:
    """In the child: descriptor 2 to the supervisor's FIFO for role. Returns a descriptor
    of the original standard error, where log records go; None when there is no FIFO (a
    child run on its own), descriptor 2 left as it was."""
    fifo = open_writer(run_dir, role)
    if fifo is None:
        return None
    original = os.dup(2)  # not inherited: the gateway is given it by name
    os.dup2(fifo, 2)
    os.close(fifo)
    return original
