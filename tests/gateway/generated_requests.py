"""Hypothesis strategies over the requests of the gateway's fast-path methods (V2
ModelInferRequest, attention.v1 AttendRequest) and their call headers. Messages are written
field by field on the protobuf wire, so any field can be missing, repeated, of another wire
type, or followed by fields no schema has: what a generated client never sends."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from tests.harness.h2_raw import Message

D = 512  # the mha model's embed_dim
MAX_BATCH, MAX_SEQ = 2, 8  # the servers' --max-batch-size and --max-seq-len

VARINT, FIXED64, BYTES, GROUP_START, GROUP_END, FIXED32 = 0, 1, 2, 3, 4, 5


# -- the protobuf wire format ----------------------------------------------------------------


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int64 as protobuf writes it: ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def f_varint(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def f_bytes(number: int, value: bytes) -> bytes:
    return tag(number, BYTES) + varint(len(value)) + value


def f_packed(number: int, values: list[int]) -> bytes:
    return f_bytes(number, b"".join(varint(v) for v in values))


@st.composite
def odd_field(draw: st.DrawFn, known: tuple[int, ...] = ()) -> bytes:
    """One field the schema does not expect: an unknown number of any wire type (a group
    included), a known number with any wire type, or a wire type that does not exist."""
    number = draw(st.sampled_from([15, 16, 99, 1000, (1 << 29) - 1, *known]))
    wire = draw(st.sampled_from([VARINT, BYTES, FIXED32, FIXED64, GROUP_START, GROUP_END, 6, 7]))
    if wire == VARINT:
        return f_varint(number, draw(st.sampled_from([0, 1, 150, -1, 1 << 63])))
    if wire == BYTES:
        return f_bytes(number, draw(st.binary(max_size=6)))
    if wire in (FIXED32, FIXED64):
        size = 4 if wire == FIXED32 else 8
        return tag(number, wire) + draw(st.binary(min_size=size, max_size=size))
    if wire == GROUP_START:  # a whole group, holding a field of its own
        return tag(number, GROUP_START) + f_varint(1, 7) + tag(number, GROUP_END)
    return tag(number, wire)  # a lone group end, or wire type 6 or 7: malformed


def odd_fields(known: tuple[int, ...] = ()) -> st.SearchStrategy[bytes]:
    return st.lists(odd_field(known), max_size=2).map(b"".join)


# -- values ----------------------------------------------------------------------------------

# Strings as bytes: mostly text, sometimes not UTF-8 (which proto3 strings must be).
texts = st.one_of(
    st.text(st.sampled_from("ab-_é√ 日"), max_size=6).map(str.encode),
    st.just(b"\xff\xfe"),
)


@st.composite
def floats(draw: st.DrawFn, count: int, itemsize: int) -> bytes:
    """count little-endian floats of itemsize bytes, sometimes with one not finite."""
    values = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(max(count, 0))
    if count > 0 and draw(st.integers(0, 9)) == 0:
        values[draw(st.integers(0, count - 1))] = draw(st.sampled_from([math.nan, math.inf]))
    return values.astype("<f2" if itemsize == 2 else "<f4").tobytes()


def elements(shape: list[int]) -> int:
    return math.prod(shape) if shape and min(shape) > 0 else 0


def shapes(rank3: bool) -> st.SearchStrategy[list[int]]:
    """Right shapes (within the servers' limits) about half the time, else wrong ones."""
    n, seq = st.integers(1, MAX_BATCH), st.integers(1, MAX_SEQ)
    right: list[st.SearchStrategy[tuple[int, ...]]] = [st.tuples(n, seq, st.just(D))]
    if not rank3:  # Attend also takes [seq, d]
        right.append(st.tuples(seq, st.just(D)))
    wrong = st.one_of(
        st.tuples(seq, st.just(D)) if rank3 else st.tuples(st.just(D)),
        st.tuples(n, seq, st.just(D), st.just(1)),
        st.tuples(st.just(0), seq, st.just(D)),
        st.tuples(n, st.just(0), st.just(D)),
        st.tuples(st.just(-1), seq, st.just(D)),
        st.tuples(n, seq, st.sampled_from([64, D - 1, D + 1])),
        st.tuples(st.just(MAX_BATCH + 1), seq, st.just(D)),
        st.tuples(n, st.just(MAX_SEQ + 1), st.just(D)),
    )
    return st.one_of(*right, wrong).map(list)


# -- V2 parameters ---------------------------------------------------------------------------

PARAMETER_NAMES = [
    "binary_data_size",  # tolerated on an input
    "binary_data",  # tolerated on an output
    "binary_data_output",  # tolerated on the request
    "priority",
    "timeout",
    "sequence_id",
    "shared_memory_region",
    "shared_memory_offset",
    "shared_memory_byte_size",
]


@st.composite
def parameter_value(draw: st.DrawFn) -> bytes:
    """An InferParameter of any of its kinds (an empty one, with none chosen, too)."""
    kind = draw(st.sampled_from(["int64", "bool", "string", "double", "uint64", "none"]))
    if kind == "int64":
        return f_varint(2, draw(st.sampled_from([0, 16, 4096, -1])))
    if kind == "bool":
        return f_varint(1, draw(st.sampled_from([1, 0])))
    if kind == "string":
        return f_bytes(3, draw(st.sampled_from([b"region", b"", b"\xff"])))
    if kind == "double":
        return tag(4, FIXED64) + struct.pack("<d", 1.5)
    if kind == "uint64":
        return f_varint(5, draw(st.sampled_from([0, 16, 1 << 63])))
    return b""


@st.composite
def parameters(draw: st.DrawFn, number: int) -> bytes:
    """Entries of a map<string, InferParameter> field; sometimes a whole region reference."""
    entries = []
    if draw(st.integers(0, 4)) == 0:
        region = f_bytes(1, b"shared_memory_region") + f_bytes(2, f_bytes(3, b"no-such-region"))
        size = f_bytes(1, b"shared_memory_byte_size") + f_bytes(2, f_varint(2, 4096))
        entries += [region, size]
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(PARAMETER_NAMES)).encode()
        entries.append(f_bytes(1, name) + f_bytes(2, draw(parameter_value())))
    return b"".join(f_bytes(number, entry) for entry in entries)


# -- ModelInferRequest -----------------------------------------------------------------------


@dataclass(frozen=True)
class V2Input:
    tensor: bytes  # an InferInputTensor
    raw: bytes | None  # its raw_input_contents entry, if it has one


@st.composite
def v2_inputs(draw: st.DrawFn) -> V2Input:
    name = draw(st.sampled_from([b"embeddings", b"embeddings", b"", b"embedding", b"\xff"]))
    datatype = draw(st.sampled_from([b"FP32", b"FP32", b"FP16", b"INT32", b"BOGUS", b""]))
    shape = draw(shapes(rank3=True))
    itemsize = 2 if datatype == b"FP16" else 4
    where = draw(st.sampled_from(["raw", "raw", "fp32", "int", "none", "both", "short", "long"]))
    count = elements(shape)
    data = draw(floats(count, itemsize))
    fields = [f_bytes(1, name), f_bytes(2, datatype), f_packed(3, shape)]
    fields.append(draw(parameters(4)))
    if where in ("fp32", "both"):  # typed contents: InferTensorContents.fp32_contents
        values = np.frombuffer(draw(floats(count, 4)), "<f4")
        fields.append(f_bytes(5, f_bytes(6, values.tobytes())))
    if where == "int":
        fields.append(f_bytes(5, f_packed(2, list(range(count)))))
    fields.append(draw(odd_fields(known=(1, 2, 3, 4, 5))))
    raw = {"raw": data, "both": data, "short": data[:-2], "long": data + b"\0\0\0\0"}.get(where)
    return V2Input(b"".join(fields), raw)


@st.composite
def v2_outputs(draw: st.DrawFn) -> bytes:
    name = draw(st.sampled_from([b"output", b"attention_weights", b"bogus", b""]))
    return f_bytes(1, name) + draw(parameters(2)) + draw(odd_fields(known=(1, 2)))


@st.composite
def plain_infer_requests(draw: st.DrawFn) -> bytes:
    """A ModelInferRequest the gateway answers itself (unknown fields and tolerated
    parameters included)."""
    shape = draw(st.tuples(st.integers(1, MAX_BATCH), st.integers(1, MAX_SEQ), st.just(D)))
    data = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(shape)
    tolerated = f_bytes(1, b"binary_data_size") + f_bytes(2, f_varint(2, data.size * 4))
    tensor = f_bytes(1, b"embeddings") + f_bytes(2, b"FP32") + f_packed(3, list(shape))
    if draw(st.booleans()):
        tensor += f_bytes(4, tolerated)
    fields = [
        f_bytes(1, draw(st.sampled_from([b"mha", b""]))),
        f_bytes(2, draw(st.sampled_from([b"", b"1"]))),
        f_bytes(3, draw(st.text(max_size=6)).encode()),
        f_bytes(5, tensor + draw(st.sampled_from([b"", f_varint(15, 1)]))),
    ]
    for name in draw(st.lists(st.sampled_from([b"output", b"attention_weights"]), max_size=3)):
        fields.append(f_bytes(6, f_bytes(1, name)))
    fields.append(f_bytes(7, data.astype("<f4").tobytes()))
    fields.append(draw(st.sampled_from([b"", f_varint(15, 1), f_bytes(1000, b"x")])))
    return b"".join(fields)


def infer_requests() -> st.SearchStrategy[bytes]:
    """ModelInferRequests: the gateway's (plain) half the time, any others the rest."""
    return st.one_of(plain_infer_requests(), any_infer_requests())


@st.composite
def any_infer_requests(draw: st.DrawFn) -> bytes:
    """A ModelInferRequest, each of its parts right or wrong."""
    fields = [
        f_bytes(1, draw(st.sampled_from([b"mha", b"mha", b"", b"nope", b"\xff"]))),
        f_bytes(2, draw(st.sampled_from([b"", b"", b"1", b"2", b"01", b"x"]))),
        f_bytes(3, draw(texts)),
        draw(parameters(4)),
    ]
    inputs = draw(st.one_of(st.lists(v2_inputs(), min_size=1, max_size=1), st.lists(v2_inputs())))
    fields += [f_bytes(5, i.tensor) for i in inputs]
    fields += [f_bytes(6, o) for o in draw(st.lists(v2_outputs(), max_size=3))]
    fields += [f_bytes(7, i.raw) for i in inputs if i.raw is not None]
    if draw(st.integers(0, 9)) == 0:  # one raw_input_contents too many
        fields.append(f_bytes(7, b"\0" * 16))
    fields.append(draw(odd_fields(known=tuple(range(1, 8)))))
    return b"".join(fields)


# -- AttendRequest ---------------------------------------------------------------------------


@st.composite
def attend_tensors(draw: st.DrawFn) -> bytes:
    shape = draw(shapes(rank3=False))
    dtype = draw(st.sampled_from([None, 1, 1, 0, 2, 7, -1]))
    itemsize = 2 if dtype == 2 else 4
    data = draw(floats(elements(shape), itemsize))
    data = draw(st.sampled_from([data, data, data, data[:-2], data + b"\0\0", b""]))
    fields = [f_packed(1, shape)]
    if dtype is not None:
        fields.append(f_varint(2, dtype))
    fields += [f_bytes(3, data), draw(odd_fields(known=(1, 2, 3)))]
    return b"".join(fields)


@st.composite
def region_refs(draw: st.DrawFn) -> bytes:
    """A SharedMemoryRef to a region no client registered (the worker, or Python, says so)."""
    region = draw(st.sampled_from([b"no-such-region", b"", b"\xff"]))
    return f_bytes(1, region) + f_varint(2, 0) + f_varint(3, draw(st.sampled_from([0, 4096])))


@st.composite
def plain_attend_requests(draw: st.DrawFn) -> bytes:
    """An AttendRequest the gateway answers itself (unknown fields included)."""
    seq = st.integers(1, MAX_SEQ)
    shape = draw(
        st.one_of(st.tuples(seq, st.just(D)), st.tuples(st.integers(1, MAX_BATCH), seq, st.just(D)))
    )
    data = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(shape)
    tensor = f_packed(1, list(shape)) + f_varint(2, draw(st.sampled_from([0, 1])))
    tensor += f_bytes(3, data.astype("<f4").tobytes())
    fields = [
        f_bytes(1, draw(st.sampled_from([b"mha", b""]))),
        f_bytes(2, draw(st.sampled_from([b"", b"1"]))),
        f_bytes(3, tensor),
        f_varint(4, draw(st.sampled_from([0, 1]))),
        f_bytes(5, draw(st.text(max_size=6)).encode()),
        draw(st.sampled_from([b"", f_varint(15, 1), f_bytes(1000, b"x")])),
    ]
    return b"".join(fields)


def attend_requests() -> st.SearchStrategy[bytes]:
    """AttendRequests: the gateway's (plain) half the time, any others the rest."""
    return st.one_of(plain_attend_requests(), any_attend_requests())


@st.composite
def any_attend_requests(draw: st.DrawFn) -> bytes:
    """An AttendRequest, each of its parts right or wrong."""
    fields = [
        f_bytes(1, draw(st.sampled_from([b"mha", b"", b"", b"nope", b"\xff"]))),
        f_bytes(2, draw(st.sampled_from([b"", b"", b"1", b"2", b"01", b"x"]))),
    ]
    if draw(st.integers(0, 9)) > 0:
        fields.append(f_bytes(3, draw(attend_tensors())))
    weights = draw(st.sampled_from([None, None, 0, 1, 2]))
    if weights is not None:
        fields.append(f_varint(4, weights))
    fields.append(f_bytes(5, draw(texts)))
    for number in (6, 7, 8):  # embeddings_region, output_region, attention_weights_region
        if draw(st.integers(0, 9)) == 0:
            fields.append(f_bytes(number, draw(region_refs())))
    fields.append(draw(odd_fields(known=tuple(range(1, 9)))))
    return b"".join(fields)


def messages(requests: st.SearchStrategy[bytes]) -> st.SearchStrategy[Message]:
    """Messages, one in ten with the compressed flag set (in calls declaring no encoding). A
    flag of neither 0 nor 1 is answered by gRPC core as it happens to (docs/architecture.md):
    none is generated."""
    return st.builds(Message, requests, st.sampled_from([0] * 9 + [1]))
