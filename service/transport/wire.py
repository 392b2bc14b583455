"""Protobuf wire encoding of messages that carry large tensor bytes, with one copy.

Serializing a message that holds a 256 KiB bytes field costs protobuf (upb) far more than
the bytes themselves: the value is copied into the message, then the encoder grows a fresh
buffer for every call. Here the small fields are serialized by protobuf as usual and the
tensor bytes are appended as hand-framed length-delimited fields, gathered by a single join
straight from the numpy array. Protobuf's wire format defines concatenated serializations
as the serialization of their merge, so every client parses exactly the message the
generated code would have produced. The parts are put together in field-number order, as
protobuf writes a whole message: the bytes are protobuf's own, the ones the Go gateway
writes too (tests/golden/grpc/ holds them for both).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message

LENGTH_DELIMITED = 2
# Joining this many bytes takes long enough to stall every other call on the event loop;
# bytes.join releases the GIL from 1 MiB on, so a worker thread does it alongside the loop.
OFF_LOOP_BYTES = 1 << 20

Chunk = bytes | memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field_number: int) -> bytes:
    return _varint(field_number << 3 | LENGTH_DELIMITED)


def array_bytes(array: np.ndarray) -> memoryview:
    """The array's little-endian, row-major bytes, without a copy when it already is so."""
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return little.reshape(-1).view(np.uint8).data


class WireMessage:
    """A serialized message as chunks, joined once when gRPC asks for the bytes."""

    __slots__ = ("chunks", "nbytes")

    def __init__(self, chunks: Sequence[Chunk] = ()) -> None:
        self.chunks: list[Chunk] = list(chunks)
        self.nbytes = sum(len(chunk) for chunk in self.chunks)

    @classmethod
    def of(cls, message: Message) -> WireMessage:
        """The small fields, serialized by protobuf."""
        return cls([message.SerializeToString(deterministic=True)])

    def add_bytes(self, field_number: int, data: Chunk) -> WireMessage:
        """Append a bytes field (or one element of a repeated bytes field)."""
        return self._add(field_number, [data], len(data))

    def add_message(self, field_number: int, message: WireMessage) -> WireMessage:
        """Append a message field whose value is already chunked."""
        return self._add(field_number, message.chunks, message.nbytes)

    def add_serialized(self, fields: bytes) -> WireMessage:
        """Append fields protobuf serialized (for protobuf's own bytes, numbered above the
        fields already here)."""
        self.chunks.append(fields)
        self.nbytes += len(fields)
        return self

    def _add(self, field_number: int, chunks: Sequence[Chunk], nbytes: int) -> WireMessage:
        head = _key(field_number) + _varint(nbytes)
        self.chunks.append(head)
        self.chunks.extend(chunks)
        self.nbytes += len(head) + nbytes
        return self

    def serialize(self) -> bytes:
        return b"".join(self.chunks)


async def settled(message: WireMessage) -> WireMessage:
    """A large message joined now on a worker thread, so the serializer, which gRPC calls on
    the event loop, only hands the bytes on (joining one bytes object returns it as is)."""
    if message.nbytes < OFF_LOOP_BYTES:
        return message
    return WireMessage([await asyncio.to_thread(message.serialize)])


def serializer_for(
    serialize_message: Callable[[Any], bytes],
) -> Callable[[Any], bytes]:
    """A gRPC response serializer that also takes WireMessage; a message is serialized
    deterministically (a map's entries in key order: the same bytes from every process)."""

    def serialize(response: Any) -> bytes:
        if isinstance(response, WireMessage):
            return response.serialize()
        if isinstance(response, Message):
            return response.SerializeToString(deterministic=True)
        return serialize_message(response)

    return serialize


async def joined(message: WireMessage) -> WireMessage:
    """The message as one chunk now (on a worker thread when large), so it no longer refers
    to the arrays it was built from: they may be freed or reused once this returns."""
    if len(message.chunks) == 1 and isinstance(message.chunks[0], bytes):
        return message
    if message.nbytes < OFF_LOOP_BYTES:
        return WireMessage([message.serialize()])
    return WireMessage([await asyncio.to_thread(message.serialize)])
