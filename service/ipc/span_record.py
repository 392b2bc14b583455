"""The record of a sampled call the gateway answered, which it sends its Python front end
(service/gateway/tracing.go writes it): the front end makes the call's spans from it.

On the gateway's spans socket each record is its length (uint32) then its body: the fixed
part below, then the method, the model name, the caller's tracestate and the worker's packed
DONE (packed.py; empty when the call was not computed), each as long as the fixed part says.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from service.ipc import packed
from service.ipc.records import Done

VERSION = 1
LENGTH = struct.Struct("<I")
# version, trace id, span id, parent span id (big-endian, as traceparent writes them; zero:
# no parent), parent flags, received and answered (Unix ns), gRPC code, model version,
# sequences, sequence length, then the four lengths.
HEAD = struct.Struct("<B16s8s8sBqqBqqqHHHH")
MAX_RECORD_BYTES = HEAD.size + 4 * 0xFFFF


@dataclass(frozen=True)
class SpanRecord:
    trace_id: int
    span_id: int
    parent_span_id: int
    parent_flags: int
    received_ns: int
    answered_ns: int
    code: int
    model_version: int
    sequences: int
    length: int
    method: str
    model: str
    trace_state: str
    done: Done | None  # the worker's answer, when it computed the call


def pack(record: SpanRecord) -> bytes:
    """The framed record, as the gateway writes it (tests use it)."""
    method, model = record.method.encode(), record.model.encode()
    state = record.trace_state.encode()
    done = b"" if record.done is None else packed.pack_done(record.done) or b""
    head = HEAD.pack(
        VERSION,
        record.trace_id.to_bytes(16, "big"),
        record.span_id.to_bytes(8, "big"),
        record.parent_span_id.to_bytes(8, "big"),
        record.parent_flags,
        record.received_ns,
        record.answered_ns,
        record.code,
        record.model_version,
        record.sequences,
        record.length,
        len(method),
        len(model),
        len(state),
        len(done),
    )
    body = head + method + model + state + done
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes | bytearray | memoryview) -> SpanRecord:
    """One record's body (after its length); ValueError when malformed."""
    try:
        (
            version,
            trace_id,
            span_id,
            parent_span_id,
            parent_flags,
            received_ns,
            answered_ns,
            code,
            model_version,
            sequences,
            length,
            *lengths,
        ) = HEAD.unpack_from(body)
    except struct.error as err:
        raise ValueError(f"malformed span record: {err}") from err
    if version != VERSION:
        raise ValueError(f"span record version {version}, expected {VERSION}")
    if len(body) != HEAD.size + sum(lengths):
        raise ValueError(f"span record of {len(body)} bytes, its lengths say otherwise")
    parts, at = [], HEAD.size
    for size in lengths:
        parts.append(bytes(body[at : at + size]))
        at += size
    method, model, state, done = parts
    try:
        return SpanRecord(
            int.from_bytes(trace_id, "big"),
            int.from_bytes(span_id, "big"),
            int.from_bytes(parent_span_id, "big"),
            parent_flags,
            received_ns,
            answered_ns,
            code,
            model_version,
            sequences,
            length,
            method.decode(),
            model.decode(),
            _header_text(state),
            packed.unpack_done(done) if done else None,
        )
    except UnicodeDecodeError as err:
        raise ValueError(f"malformed span record: {err}") from err


def _header_text(value: bytes) -> str:
    """A header's value (the caller's tracestate, any bytes) as gRPC Python gives it to the
    propagator: UTF-8, else Latin-1. The state then fails the SDK's checks as it does there
    (the span is made without it), where a decoding error lost the record, and the records
    the gateway sent after it on the same connection."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")
