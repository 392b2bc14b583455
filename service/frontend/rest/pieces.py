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


def loads(text: bytes) -> Any:
    """json.loads; for text beyond INLINE_BYTES, with the numbers parsed by Python hooks, so
    a thread decoding it holds the GIL for microseconds at a time, not for the whole text
    (about 20% slower)."""
    if len(text) <= INLINE_BYTES:
        return json.loads(text)
    return json.loads(text, parse_float=_number, parse_int=_integer)


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
    rows = len(data) if per_item == 0 else PIECE_VALUES // per_item
    if rows == 0:  # each item alone is more than a piece: go one level down
        for item in data:
            if _leading_shape(item) != inner:
                raise ValueError(f"its rows differ in shape; expected each {list(inner)}")
            yield from flat_pieces(item)
        return
    for start in range(0, len(data), rows):
        piece = np.asarray(data[start : start + rows])  # ValueError when ragged inside
        if piece.shape[1:] != inner:
            raise ValueError(f"its rows differ in shape; expected each {list(inner)}")
        yield piece.reshape(-1)
