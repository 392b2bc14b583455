"""What a request's two control messages cost in each process, by how they are held: a dict
with one-letter keys, a dataclass with slots, a NamedTuple, or a plain class with __slots__.

Each figure is one message's life in the worker loop's terms, with the packed layout of
service/ipc/packed.py: the sender builds it and packs it, the receiver unpacks it and reads
every field it uses (INFER: front end -> worker; DONE: worker -> front end). Untraced. Pin
it to one CPU:

    taskset -c 1 python -m bench.ipc_records
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

_INFER = struct.Struct("<BQ?qqqqqqdHB")
_DONE = struct.Struct("<BQddqddq")
KEY, DTYPE = "mha/1", "<f4"


# -- (a) dicts, as the messages were ---------------------------------------------------------


def _dict_infer() -> Any:
    message: dict[str, Any] = {
        "t": "infer",
        "model": KEY,
        "w": False,
        "shape": [1, 16, 512],
        "dtype": DTYPE,
        "in": 0,
        "out": 32768,
    }
    message.update(deadline=812.5, tag=None)
    message["id"] = 41
    key, dtype = message["model"].encode(), message["dtype"].encode()
    body = _INFER.pack(
        1,
        message["id"],
        message["w"],
        *message["shape"],
        message.get("in", -1),
        message.get("out", -1),
        message.get("wout", -1),
        message["deadline"],
        len(key),
        len(dtype),
    )
    body += key + dtype
    (_, request_id, w, n, seq, d, at_in, at_out, at_wout, deadline, key_len, dtype_len) = (
        _INFER.unpack_from(body)
    )
    end = _INFER.size + key_len
    got: dict[str, Any] = {
        "t": "infer",
        "id": request_id,
        "model": body[_INFER.size : end].decode(),
        "w": w,
        "shape": [n, seq, d],
        "dtype": body[end : end + dtype_len].decode(),
        "deadline": None if math.isnan(deadline) else deadline,
        "tag": None,
    }
    if at_in >= 0:
        got["in"] = at_in
    if at_out >= 0:
        got["out"] = at_out
    if at_wout >= 0:
        got["wout"] = at_wout
    return (
        got["t"],
        got["id"],
        got["model"],
        got["dtype"],
        got["shape"],
        got.get("iref"),
        got["in"],
        got["w"],
        got.get("oref"),
        got["out"],
        got.get("deadline"),
        got.get("tag"),
    )


def _dict_done() -> Any:
    message = {
        "t": "done",
        "id": 41,
        "q": 0.002,
        "c": 0.0005,
        "b": 6,
        "s": 811.25,
        "p": 0.125,
        "i": 9,
        "tags": [],
    }
    body = _DONE.pack(
        2,
        message["id"],
        message["q"],
        message["c"],
        message["b"],
        message["s"],
        message["p"],
        message["i"],
    )
    _, request_id, q, c, b, s, p, i = _DONE.unpack_from(body)
    got = {"t": "done", "id": request_id, "q": q, "c": c, "b": b, "s": s, "p": p, "i": i}
    got["tags"] = []
    return (
        got["t"],
        got["id"],
        got["q"],
        got["c"],
        got["b"],
        got["s"],
        got["p"],
        got["i"],
        got["tags"],
    )


# -- (b, c, d) records -----------------------------------------------------------------------


@dataclass(slots=True)
class _SlotsInfer:
    request_id: int
    model_key: str
    with_weights: bool
    shape: tuple[int, ...]
    dtype: str
    deadline: float | None
    input_offset: int | None = None
    output_offset: int | None = None
    weights_offset: int | None = None
    tag: tuple[int, int, int] | None = None


@dataclass(slots=True)
class _SlotsDone:
    request_id: int
    queue_s: float
    compute_s: float
    batch_size: int
    started_at: float
    padding: float
    batch_id: int
    tags: tuple[tuple[int, int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class _FrozenInfer:
    request_id: int
    model_key: str
    with_weights: bool
    shape: tuple[int, ...]
    dtype: str
    deadline: float | None
    input_offset: int | None = None
    output_offset: int | None = None
    weights_offset: int | None = None
    tag: tuple[int, int, int] | None = None


@dataclass(slots=True, frozen=True)
class _FrozenDone:
    request_id: int
    queue_s: float
    compute_s: float
    batch_size: int
    started_at: float
    padding: float
    batch_id: int
    tags: tuple[tuple[int, int, int], ...] = ()


class _TupleInfer(NamedTuple):
    request_id: int
    model_key: str
    with_weights: bool
    shape: tuple[int, ...]
    dtype: str
    deadline: float | None
    input_offset: int | None = None
    output_offset: int | None = None
    weights_offset: int | None = None
    tag: tuple[int, int, int] | None = None


class _TupleDone(NamedTuple):
    request_id: int
    queue_s: float
    compute_s: float
    batch_size: int
    started_at: float
    padding: float
    batch_id: int
    tags: tuple[tuple[int, int, int], ...] = ()


class _PlainInfer:
    __slots__ = (
        "deadline",
        "dtype",
        "input_offset",
        "model_key",
        "output_offset",
        "request_id",
        "shape",
        "tag",
        "weights_offset",
        "with_weights",
    )

    def __init__(
        self,
        request_id: int,
        model_key: str,
        with_weights: bool,
        shape: tuple[int, ...],
        dtype: str,
        deadline: float | None,
        input_offset: int | None = None,
        output_offset: int | None = None,
        weights_offset: int | None = None,
        tag: tuple[int, int, int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.model_key = model_key
        self.with_weights = with_weights
        self.shape = shape
        self.dtype = dtype
        self.deadline = deadline
        self.input_offset = input_offset
        self.output_offset = output_offset
        self.weights_offset = weights_offset
        self.tag = tag


class _PlainDone:
    __slots__ = (
        "batch_id",
        "batch_size",
        "compute_s",
        "padding",
        "queue_s",
        "request_id",
        "started_at",
        "tags",
    )

    def __init__(
        self,
        request_id: int,
        queue_s: float,
        compute_s: float,
        batch_size: int,
        started_at: float,
        padding: float,
        batch_id: int,
        tags: tuple[tuple[int, int, int], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.queue_s = queue_s
        self.compute_s = compute_s
        self.batch_size = batch_size
        self.started_at = started_at
        self.padding = padding
        self.batch_id = batch_id
        self.tags = tags


def _record_infer(cls: Callable[..., Any]) -> Callable[[], Any]:
    def run() -> Any:
        message = cls(41, KEY, False, (1, 16, 512), DTYPE, 812.5, 0, 32768, None, None)
        key, dtype = message.model_key.encode(), message.dtype.encode()
        deadline, at_wout = message.deadline, message.weights_offset
        body = _INFER.pack(
            1,
            message.request_id,
            message.with_weights,
            *message.shape,
            -1 if message.input_offset is None else message.input_offset,
            -1 if message.output_offset is None else message.output_offset,
            -1 if at_wout is None else at_wout,
            math.nan if deadline is None else deadline,
            len(key),
            len(dtype),
        )
        body += key + dtype
        (_, request_id, w, n, seq, d, at_in, at_out, at_wout, deadline, key_len, dtype_len) = (
            _INFER.unpack_from(body)
        )
        end = _INFER.size + key_len
        got = cls(
            request_id,
            body[_INFER.size : end].decode(),
            w,
            (n, seq, d),
            body[end : end + dtype_len].decode(),
            None if math.isnan(deadline) else deadline,
            at_in if at_in >= 0 else None,
            at_out if at_out >= 0 else None,
            at_wout if at_wout >= 0 else None,
            None,
        )
        return (
            type(got),
            got.request_id,
            got.model_key,
            got.dtype,
            got.shape,
            got.input_offset,
            got.with_weights,
            got.output_offset,
            got.weights_offset,
            got.deadline,
            got.tag,
        )

    return run


def _record_done(cls: Callable[..., Any]) -> Callable[[], Any]:
    def run() -> Any:
        message = cls(41, 0.002, 0.0005, 6, 811.25, 0.125, 9, ())
        body = _DONE.pack(
            2,
            message.request_id,
            message.queue_s,
            message.compute_s,
            message.batch_size,
            message.started_at,
            message.padding,
            message.batch_id,
        )
        _, request_id, q, c, b, s, p, i = _DONE.unpack_from(body)
        got = cls(request_id, q, c, b, s, p, i, ())
        return (
            type(got),
            got.request_id,
            got.queue_s,
            got.compute_s,
            got.batch_size,
            got.started_at,
            got.padding,
            got.batch_id,
            got.tags,
        )

    return run


VARIANTS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "dict": (_dict_infer, _dict_done),
    "dataclass(slots=True)": (_record_infer(_SlotsInfer), _record_done(_SlotsDone)),
    "dataclass(slots=True, frozen=True)": (_record_infer(_FrozenInfer), _record_done(_FrozenDone)),
    "NamedTuple": (_record_infer(_TupleInfer), _record_done(_TupleDone)),
    "class with __slots__": (_record_infer(_PlainInfer), _record_done(_PlainDone)),
}


def _best_us(call: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=100_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings; the best is kept")
    args = parser.parse_args()
    results = {
        name: {
            "infer_us": round(_best_us(infer, args.number, args.repeat), 3),
            "done_us": round(_best_us(done, args.number, args.repeat), 3),
        }
        for name, (infer, done) in VARIANTS.items()
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
