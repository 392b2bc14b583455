"""JSON tensors in bounded pieces.

json.dumps of a list, json.loads and np.asarray of a list are each one C call that holds the
GIL throughout: on a tensor of millions of values, seconds in which the front end's event loop
cannot run (every connection stalls, and the supervisor's watchdog takes the silence for a
hang). Here each such call takes at most PIECE_VALUES values, and JSON numbers are parsed
through Python-level hooks, so that a thread running this code gives the GIL back to the event
loop every few milliseconds (Python switches threads between bytecodes, never inside a C
call). The REST front end runs anything larger than INLINE_BYTES on its codec thread.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

# About 5 ms of json.dumps on one core (a float's repr takes ~0.6 us).
PIECE_VALUES = 8192
# JSON this short is decoded (and answers this short encoded) on the event loop: ~1 ms.
INLINE_BYTES = 64 << 10


def encode_values(array: np.ndarray) -> Iterator[bytes]:
    """The array's values, row-major, as the inside of a JSON array ("1.5,-2.0,..."), in
    pieces of at most PIECE_VALUES values (the same text one json.dumps of the list gives)."""
    flat = array.reshape(-1)
    for start in range(0, flat.size, PIECE_VALUES):
        text = json.dumps(flat[start : start + PIECE_VALUES].tolist(), separators=(",", ":"))
        yield (text[1:-1] if start == 0 else "," + text[1:-1]).encode()


def _number(text: str) -> float:
    return float(text)  # a Python frame per number: the point where threads may switch


def _integer(text: str) -> int:
    return int(text)  # ValueError beyond Python's digit limit, as json.loads raises it


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)  # a Python frame per object, as _number is per number


class HookFree(ValueError):
    """JSON whose parse would hold the GIL too long between two hook calls."""


# Scanned in slices of this many bytes (each count a short C call).
SCAN_BYTES = 64 << 10
# Strings have no hook: the quotes a large body may hold (names, datatypes, parameters; a
# tensor's data is numbers). Each string costs one short C scan.
MAX_QUOTES = 1 << 14
# Objects have a hook, but a request holds few (its inputs, outputs and parameters):
# millions of them (`[{},{},...]`) cost a garbage collection pass over them all while parsing,
# and freeing them once refused, each holding the GIL for a tenth of a second or more.
MAX_OBJECTS = 1 << 10
# In each slice outside strings, at most this many more containers and literals than hooked
# tokens (digits, objects): each a C allocation with no Python frame between (~0.1 us each).
SLACK_TOKENS = 4096
_HOOKED = bytes(range(256)).translate(None, b"0123456789{")  # all bytes but these: deleted
_UNHOOKED = bytes(range(256)).translate(None, b"[ntf")  # "[", null, true, false


def _outside_strings(text: bytes) -> bytes:
    """text without its JSON strings (their quotes found by a bounded Python loop)."""
    if text.count(b'"') > MAX_QUOTES:
        raise HookFree(
            f"holds more than {MAX_QUOTES // 2} strings (names and parameters are few); "
            "expected tensor data as numbers"
        )
    parts: list[bytes] = []
    start = position = 0
    while (opening := text.find(b'"', position)) >= 0:
        closing = opening
        while True:
            closing = text.find(b'"', closing + 1)
            if closing < 0:
                return b"".join([*parts, text[start:opening]])  # json.loads says what is wrong
            if not _escaped(text, opening, closing):
                break
        parts.append(text[start:opening])
        start = position = closing + 1
    parts.append(text[start:])
    return b"".join(parts)


def _escaped(text: bytes, opening: int, closing: int) -> bool:
    """Whether the quote at closing follows an odd number of backslashes (looked at 64 bytes
    at a time: never a copy of the whole string)."""
    count, end = 0, closing
    while end > opening + 1:
        window = text[max(opening + 1, end - 64) : end]
        kept = window.rstrip(b"\\")
        count += len(window) - len(kept)
        if kept:
            break
        end -= len(window)
    return count % 2 == 1


def check_hooked(text: bytes) -> None:
    """HookFree unless parsing text with the hooks of loads() calls a hook every few
    thousand tokens: JSON of millions of empty arrays, strings or nulls (no number, so no
    hook) held the GIL for seconds; so did millions of objects (MAX_OBJECTS). The scan reads
    UTF-8 only (json.loads would also take UTF-16 and UTF-32, whose bytes it misreads)."""
    encoding = json.detect_encoding(text)
    if encoding not in ("utf-8", "utf-8-sig"):  # a BOM: json.loads says what is wrong
        raise HookFree(f"is {encoding.upper()} JSON; expected UTF-8 (RFC 8259)")
    bare = _outside_strings(text)
    if bare.count(b"{") > MAX_OBJECTS:
        raise HookFree(
            f"holds more than {MAX_OBJECTS} objects; a request holds a few (such as its "
            "inputs, outputs and parameters), and tensor data as numbers"
        )
    for start in range(0, len(bare), SCAN_BYTES):
        piece = bare[start : start + SCAN_BYTES]
        unhooked = len(piece.translate(None, _UNHOOKED))
        if unhooked > SLACK_TOKENS and unhooked > len(piece.translate(None, _HOOKED)):
            raise HookFree(
                "holds long runs of arrays or literals without numbers (e.g. [[],[],...]); "
                "expected tensor data as numbers"
            )


def loads(text: bytes) -> Any:
    """json.loads; for text beyond INLINE_BYTES, with numbers and objects parsed by Python
    hooks, so a thread decoding it holds the GIL for microseconds at a time, not for the whole
    text (about 20% slower); HookFree (before parsing) for such text that would run long with
    no hook (check_hooked)."""
    if len(text) <= INLINE_BYTES:
        return json.loads(text)
    check_hooked(text)
    return json.loads(text, parse_float=_number, parse_int=_integer, object_pairs_hook=_object)


def _leading_shape(data: Any) -> tuple[int, ...]:
    """The shape nested lists have if they are regular (the lengths of the first items)."""
    shape = []
    while isinstance(data, list):
        shape.append(len(data))
        data = data[0] if data else None
    return tuple(shape)


def flat_pieces(data: Any) -> Iterator[np.ndarray]:
    """JSON "data" (a number, or lists of numbers nested to any depth) as 1-D arrays, in
    row-major order, of at most about PIECE_VALUES values each; ValueError when the nesting is
    ragged."""
    if not isinstance(data, list):
        yield np.asarray(data).reshape(-1)
        return
    inner = _leading_shape(data)[1:]
    per_item = math.prod(inner)
    # A zero inner dimension holds no values (never a legal tensor), but may hold millions of
    # empty lists: pieces of PIECE_VALUES of them.
    rows = PIECE_VALUES if per_item == 0 else PIECE_VALUES // per_item
    if rows == 0:  # each item alone is more than a piece: go one level down
        for item in data:
            if _leading_shape(item) != inner:
                raise ValueError(f"its rows differ in shape; expected each {list(inner)}")
            yield from flat_pieces(item)
        return
    for start in range(0, len(data), rows):
        items = data[start : start + rows]
        piece = np.asarray(items)  # ValueError when ragged inside
        if piece.shape[1:] != inner:
            raise ValueError(f"its rows differ in shape; expected each {list(inner)}")
        if piece.dtype.kind in "fiu" and _holds_booleans(items, len(inner)):
            # numpy read true as 1 and false as 0 among numbers; JSON's booleans are no numbers.
            yield piece.astype(bool)  # the caller refuses booleans
            return
        yield piece.reshape(-1)


def _holds_booleans(items: list[Any], depth: int) -> bool:
    """Whether lists nested depth deep below items hold a JSON boolean (C-level loops: about
    a fifth of the piece's np.asarray)."""
    for _ in range(depth):
        items = list(itertools.chain.from_iterable(items))
    return bool in set(map(type, items))
