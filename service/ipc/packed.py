"""The two messages every request sends, INFER and DONE, in a fixed binary layout.

Under load they are nearly all the traffic, and JSON cost both processes about 40 us per
request (encode and decode, each way; measured with timeit on the messages below); these
layouts cost a few. A message with anything the layout has no field for (a tensor in a
client's region) goes as JSON instead, so both forms decode to the same dict.

A traced request's tag (its trace id, span id and flags) follows an INFER's dtype; the tags
of a traced request's batch follow its DONE, TAG.size bytes each.

A packed body starts with its kind byte, which JSON's "{" can never be.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from service.ipc import messages

INFER_KIND, DONE_KIND = 1, 2
# kind, id, wants weights, n, seq, d, in / out / wout offsets (-1: none), deadline (NaN:
# none), then the model key and the dtype name, each after its length.
_INFER = struct.Struct("<BQ?qqqqqqdHB")
# kind, id, queue s, compute s, batch size, started at, padding, batch id.
_DONE = struct.Struct("<BQddqddq")
# A trace tag: trace id and span id (big-endian, as W3C traceparent writes them), flags.
TAG = struct.Struct(">16s8sB")
_OFFSETS = ("in", "out", "wout")
_INFER_KEYS = frozenset({"t", "id", "model", "w", "shape", "dtype", "deadline", "tag", *_OFFSETS})
_DONE_KEYS = frozenset({"t", "id", "q", "c", "b", "s", "p", "i", "tags"})
MAX_KEY_BYTES = 0xFFFF
MAX_DTYPE_BYTES = 0xFF


def pack(message: dict[str, Any]) -> bytes | None:
    """The message's packed body, or None when it needs JSON."""
    kind = message.get("t")
    try:
        if kind == messages.INFER:
            return _pack_infer(message)
        if kind == messages.DONE and message.keys() <= _DONE_KEYS:
            head = _DONE.pack(
                DONE_KIND,
                message["id"],
                message["q"],
                message["c"],
                message["b"],
                message["s"],
                message["p"],
                message["i"],
            )
            return head + b"".join(_pack_tag(tag) for tag in message["tags"])
    except (struct.error, TypeError, KeyError, ValueError, OverflowError, IndexError):
        pass  # a value outside the layout's fields (out of range, not UTF-8): JSON carries it
    return None


def _pack_tag(tag: list[int]) -> bytes:
    """A tag as tracing.tag_to_json writes it: [trace id, span id, flags]."""
    trace_id, span_id, flags = tag
    return TAG.pack(int(trace_id).to_bytes(16, "big"), int(span_id).to_bytes(8, "big"), flags)


def _unpack_tags(body: bytes | bytearray, start: int) -> list[list[int]]:
    if (len(body) - start) % TAG.size:
        raise ValueError(f"packed message of {len(body)} bytes, its lengths say otherwise")
    return [
        [int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"), flags]
        for trace_id, span_id, flags in TAG.iter_unpack(body[start:])
    ]


def _pack_infer(message: dict[str, Any]) -> bytes | None:
    if not message.keys() <= _INFER_KEYS:
        return None  # a tensor in a client's region
    shape = message["shape"]
    if len(shape) != 3:
        return None  # the worker says what is wrong with it
    key, dtype = message["model"].encode(), message["dtype"].encode()
    if len(key) > MAX_KEY_BYTES or len(dtype) > MAX_DTYPE_BYTES:
        return None
    deadline = message.get("deadline")
    head = _INFER.pack(
        INFER_KIND,
        message["id"],
        message["w"],
        *shape,
        message.get("in", -1),
        message.get("out", -1),
        message.get("wout", -1),
        math.nan if deadline is None else deadline,
        len(key),
        len(dtype),
    )
    tag = message.get("tag")
    return head + key + dtype + (b"" if tag is None else _pack_tag(tag))


def is_packed(body: bytes | bytearray) -> bool:
    return len(body) > 0 and body[0] in (INFER_KIND, DONE_KIND)


def unpack(body: bytes | bytearray) -> dict[str, Any]:
    """The dict the JSON form of the message decodes to; ValueError when malformed."""
    try:
        if body[0] == DONE_KIND:
            _, request_id, q, c, b, s, p, i = _DONE.unpack_from(body)
            return {
                "t": messages.DONE,
                "id": request_id,
                "q": q,
                "c": c,
                "b": b,
                "s": s,
                "p": p,
                "i": i,
                "tags": _unpack_tags(body, _DONE.size),
            }
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
        ) = _INFER.unpack_from(body)
        end = _INFER.size + key_len
        if len(body) not in (end + dtype_len, end + dtype_len + TAG.size):
            raise ValueError(f"packed INFER of {len(body)} bytes, its lengths say otherwise")
        key, dtype = body[_INFER.size : end].decode(), body[end : end + dtype_len].decode()
        tags = _unpack_tags(body, end + dtype_len)
    except (struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"malformed packed message: {err}") from err
    message: dict[str, Any] = {
        "t": messages.INFER,
        "id": request_id,
        "model": key,
        "w": with_weights,
        "shape": [n, seq, d],
        "dtype": dtype,
        "deadline": None if math.isnan(deadline) else deadline,
        "tag": tags[0] if tags else None,
    }
    if at_in >= 0:
        message["in"] = at_in
    if at_out >= 0:
        message["out"] = at_out
    if at_wout >= 0:
        message["wout"] = at_wout
    return message
