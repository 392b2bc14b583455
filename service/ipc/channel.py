"""Control messages between a front end and the worker, each framed by its length, over a
Unix socket; the slab's descriptor goes with the first one (SCM_RIGHTS).

Each message is a record (records.py); codec.py writes it as JSON, or, for the two messages
of every request (INFER, DONE), in a fixed binary layout (packed.py). JSON because messages
are a handful of numbers and names (tensors never travel here), it needs no schema compiler,
and a malformed message fails to decode instead of running code as a pickle could.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import struct

from service.ipc import codec
from service.ipc.records import Hello, Message

HEADER = struct.Struct("<I")
MAX_MESSAGE_BYTES = 16 << 20  # a model snapshot or statistics reply; far above any real one
HELLO_TIMEOUT_S = 10.0


class ChannelClosed(ConnectionError):
    """The other process closed its end (it exited or was killed)."""


def encode(message: Message | Hello) -> bytes:
    """The message framed: its length, then its body."""
    body = codec.encode(message)
    return HEADER.pack(len(body)) + body


READ_CHUNK_BYTES = 1 << 16


class Framer:
    """Splits bytes as they arrive into whole messages: every whole one that has arrived at
    once, so under load one wake-up of a process takes many requests' messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[Message]:
        """The messages chunk completes (none while one is still partial)."""
        self.add(chunk)
        return self.split()

    def add(self, chunk: bytes) -> None:
        self._buffer += chunk

    def split(self) -> list[Message]:
        """Every whole message buffered; ValueError for a malformed one, once the good ones
        before it have been returned."""
        buffer, start = self._buffer, 0
        messages: list[Message] = []
        while len(buffer) - start >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer, start)
            if length > MAX_MESSAGE_BYTES:
                if messages:
                    break  # the good ones before it first; the next read raises
                raise ValueError(f"control message of {length} bytes (max {MAX_MESSAGE_BYTES})")
            end = start + HEADER.size + length
            if end > len(buffer):
                break
            try:
                messages.append(codec.decode(buffer[start + HEADER.size : end]))
            except ValueError:
                if not messages:
                    raise
                break  # the good ones before it first; the next read raises
            start = end
        if start:
            del buffer[:start]
        return messages


class Reader:
    """Reads framed messages from a stream, every whole one that has arrived at once."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._framer = Framer()

    async def read(self) -> list[Message]:
        """The next messages (at least one); ChannelClosed once the other end has gone."""
        while True:
            messages = self._framer.split()
            if messages:
                return messages
            try:
                chunk = await self._reader.read(READ_CHUNK_BYTES)
            except ConnectionError as err:
                raise ChannelClosed("the other process closed the channel") from err
            if not chunk:
                raise ChannelClosed("the other process closed the channel")
            self._framer.add(chunk)


class Writer:
    """Writes framed messages; a closed peer is noticed by the reader, not here.

    Messages sent during one turn of the event loop leave in one write at its end: under load
    one system call (and one wake-up of the other process) carries many requests' messages,
    and no message waits longer than the turn that sent it."""

    def __init__(self, writer: asyncio.StreamWriter | asyncio.WriteTransport) -> None:
        self._writer = writer
        self._pending: list[bytes] = []
        # Made on its loop, and kept: CPython 3.11's asyncio.get_running_loop() asks the
        # kernel for the pid on each call.
        self._loop = asyncio.get_running_loop()

    def send(self, message: Message) -> None:
        if self._writer.is_closing():
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(encode(message))

    def flush(self) -> None:
        """Write what was sent so far now, rather than at the end of the turn."""
        self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._writer.is_closing():
            self._writer.write(b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._writer.close()


def send_hello(sock: socket.socket, message: Hello, fds: list[int]) -> None:
    """The first message, with descriptors, on a blocking socket."""
    socket.send_fds(sock, [encode(message)], fds)


def receive_hello(sock: socket.socket) -> tuple[Hello, list[int]]:
    """The first message and its descriptors, on a blocking socket (timeout set by caller).
    On any error the descriptors that did arrive are closed."""
    data, fds, flags, _ = socket.recv_fds(sock, 1 << 16, 4)
    try:
        if flags & socket.MSG_CTRUNC:
            # The kernel drops descriptors it cannot install, most often at the open-file limit.
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            raise ValueError(
                f"the hello's descriptors were dropped by the kernel (open-file limit {soft} "
                "reached here?)"
            )
        if len(data) < HEADER.size:
            raise ValueError("hello message too short")
        (length,) = HEADER.unpack(data[: HEADER.size])
        if len(data) != HEADER.size + length:
            raise ValueError(f"hello message of {len(data)} bytes, header says {length}")
        return codec.decode_hello(data[HEADER.size :]), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
