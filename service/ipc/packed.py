"""The two messages every request sends, InferRequest and Done, in a fixed binary layout.

Under load they are nearly all the traffic, and JSON cost both processes about 40 us per
request (encode and decode, each way; measured with timeit); these layouts cost a few. A
message with anything the layout has no field for (a tensor in a client's region, a value out
of its range) goes as JSON instead (codec.py); both forms decode to the same record.

A traced request's tag (its trace id, span id and flags) follows an INFER's dtype; the tags
of a traced request's batch follow its DONE, TAG.size bytes each.

A packed body starts with its kind byte, which JSON's "{" can never be. The Go gateway
writes and reads the same layouts (service/gateway/worker.go); tests/golden/*.msg hold them.
"""

from __future__ import annotations

import math
import struct

from service.ipc.records import Done, InferRequest, TraceTag

INFER_KIND, DONE_KIND = 1, 2
# Each layout's fields by name, with their struct codes (the Go gateway's offsets and sizes
# are generated from these: scripts/go_wire_contract.py).
# INFER: an offset of -1 is none, a NaN deadline none; the model key and the dtype name
# follow, each as long as its length says.
INFER_FIELDS = {
    "kind": "B",
    "request_id": "Q",
    "with_weights": "?",
    "n": "q",
    "seq": "q",
    "d": "q",
    "input_offset": "q",
    "output_offset": "q",
    "weights_offset": "q",
    "deadline": "d",
    "key_length": "H",
    "dtype_length": "B",
}
DONE_FIELDS = {
    "kind": "B",
    "request_id": "Q",
    "queue_s": "d",
    "compute_s": "d",
    "batch_size": "q",
    "started_at": "d",
    "padding": "d",
    "batch_id": "q",
}
# A trace tag: trace id and span id (big-endian, as W3C traceparent writes them), flags.
TAG_FIELDS = {"trace_id": "16s", "span_id": "8s", "flags": "B"}
INFER = struct.Struct("<" + "".join(INFER_FIELDS.values()))
DONE = struct.Struct("<" + "".join(DONE_FIELDS.values()))
TAG = struct.Struct(">" + "".join(TAG_FIELDS.values()))
MAX_KEY_BYTES = 0xFFFF
MAX_DTYPE_BYTES = 0xFF
# What a value outside the layout's fields raises while packing (out of range, not UTF-8).
_UNFIT = (struct.error, TypeError, ValueError, OverflowError)


def pack_infer(message: InferRequest) -> bytes | None:
    """The request's packed body, or None when it needs JSON."""
    if message.input_ref or message.output_ref or message.weights_ref:
        return None  # a tensor in a client's region
    if len(message.shape) != 3:
        return None  # the worker says what is wrong with it
    try:
        key, dtype = message.model_key.encode(), message.dtype.encode()
        if len(key) > MAX_KEY_BYTES or len(dtype) > MAX_DTYPE_BYTES:
            return None
        deadline, at_in = message.deadline, message.input_offset
        at_out, at_wout = message.output_offset, message.weights_offset
        head = INFER.pack(
            INFER_KIND,
            message.request_id,
            message.with_weights,
            *message.shape,
            -1 if at_in is None else at_in,
            -1 if at_out is None else at_out,
            -1 if at_wout is None else at_wout,
            math.nan if deadline is None else deadline,
            len(key),
            len(dtype),
        )
        tag = message.tag
        return head + key + dtype + (b"" if tag is None else _pack_tag(tag))
    except _UNFIT:
        return None


def pack_done(message: Done) -> bytes | None:
    """The answer's packed body, or None when it needs JSON."""
    try:
        head = DONE.pack(
            DONE_KIND,
            message.request_id,
            message.queue_s,
            message.compute_s,
            message.batch_size,
            message.started_at,
            message.padding,
            message.batch_id,
        )
        tags = message.tags
        return head + b"".join([_pack_tag(tag) for tag in tags]) if tags else head
    except _UNFIT:
        return None


def _pack_tag(tag: TraceTag) -> bytes:
    trace_id, span_id, flags = tag
    return TAG.pack(trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"), flags)


def _unpack_tags(body: bytes | bytearray, start: int) -> tuple[TraceTag, ...]:
    if len(body) == start:
        return ()  # untraced: most messages
    if (len(body) - start) % TAG.size:
        raise ValueError(f"packed message of {len(body)} bytes, its lengths say otherwise")
    return tuple(
        (int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"), flags)
        for trace_id, span_id, flags in TAG.iter_unpack(body[start:])
    )


def is_packed(body: bytes | bytearray) -> bool:
    return len(body) > 0 and body[0] in (INFER_KIND, DONE_KIND)


def unpack(body: bytes | bytearray) -> InferRequest | Done:
    """The record a packed body holds; ValueError when malformed."""
    try:
        if body[0] == DONE_KIND:
            return unpack_done(body)
        return _unpack_infer(body)
    except (struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"malformed packed message: {err}") from err


def unpack_done(body: bytes | bytearray) -> Done:
    """A packed DONE (as the gateway also hands it on in a span record); ValueError when
    malformed."""
    if not body or body[0] != DONE_KIND:
        raise ValueError(f"a packed DONE starts with {DONE_KIND}, got {bytes(body[:1])!r}")
    try:
        _, request_id, queue_s, compute_s, batch_size, started_at, padding, batch_id = (
            DONE.unpack_from(body)
        )
    except struct.error as err:
        raise ValueError(f"malformed packed DONE: {err}") from err
    return Done(
        request_id=request_id,
        queue_s=queue_s,
        compute_s=compute_s,
        batch_size=batch_size,
        started_at=started_at,
        padding=padding,
        batch_id=batch_id,
        tags=_unpack_tags(body, DONE.size),
    )


def _unpack_infer(body: bytes | bytearray) -> InferRequest:
    (
        _,
        request_id,
        with_weights,
        n,
        seq,
        d,
        at_in,
        at_out,
        at_wout,
        deadline,
        key_len,
        dtype_len,
    ) = INFER.unpack_from(body)
    end = INFER.size + key_len
    if len(body) not in (end + dtype_len, end + dtype_len + TAG.size):
        raise ValueError(f"packed INFER of {len(body)} bytes, its lengths say otherwise")
    tags = _unpack_tags(body, end + dtype_len)
    return InferRequest(
        request_id=request_id,
        model_key=body[INFER.size : end].decode(),
        with_weights=with_weights,
        shape=(n, seq, d),
        dtype=body[end : end + dtype_len].decode(),
        deadline=None if math.isnan(deadline) else deadline,
        input_offset=at_in if at_in >= 0 else None,
        output_offset=at_out if at_out >= 0 else None,
        weights_offset=at_wout if at_wout >= 0 else None,
        tag=tags[0] if tags else None,
    )
