"""The control messages as records and bytes (service/ipc/codec.py): every kind reads back as
it was written; INFER and DONE are packed where their layout fits (byte for byte the golden
files the Go gateway's tests read too) and JSON with the wire's keys otherwise; malformed
bytes are a ValueError that names what is wrong."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from service.catalog import BatchCaps, ModelSpec, ModelView
from service.dataplane import RegionRef
from service.ipc import codec, packed
from service.ipc.records import (
    Call,
    Cancel,
    ClientTensor,
    Done,
    ErrorText,
    Fail,
    Hello,
    InferRequest,
    Message,
    Models,
    Reply,
    Sync,
    Synced,
    Welcome,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
INFER = InferRequest(
    request_id=41,
    model_key="mha/1",
    with_weights=True,
    shape=(2, 16, 512),
    dtype="<f4",
    deadline=812.5,
    input_offset=0,
    output_offset=65536,
    weights_offset=131072,
)
DONE = Done(
    request_id=41,
    queue_s=0.002,
    compute_s=0.0005,
    batch_size=6,
    started_at=811.25,
    padding=0.125,
    batch_id=9,
)
OUTPUT_ONLY = dataclasses.replace(INFER, with_weights=False, weights_offset=None)
TRACE_ID, SPAN_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x1122334455667788
# The golden files' messages (tests/golden/*.msg).
INFER_TRACED = dataclasses.replace(INFER, tag=(TRACE_ID, SPAN_ID, 1))
DONE_TRACED = dataclasses.replace(DONE, tags=((TRACE_ID, SPAN_ID, 1), (1, 2**64 - 1, 0)))
REGION = ClientTensor(RegionRef("r", 0, 64, "input 'embeddings'"), "<f4")
MODEL = ModelView(
    key="mha/1",
    spec=ModelSpec("mha", 1, 512, 8, False, np.dtype("float32"), "ab12", "seeded"),
    provider="CPUExecutionProvider",
    batch_caps=BatchCaps(((16, 8), (128, 2))),
    has_weights_graph=True,
)

EVERY_KIND: list[Message] = [
    INFER,
    dataclasses.replace(OUTPUT_ONLY, input_offset=None, input_ref=REGION, output_ref=REGION),
    Cancel(3),
    Call(4, "statistics", {"keys": ["mha/1"]}),
    Synced(5),
    DONE_TRACED,
    Fail(6, ErrorText("QueueFull", "queue full: 64 requests waiting")),
    Reply(7, result=[["mha", 1, "READY", ""]]),
    Reply(8),
    Reply(9, error=ErrorText("Internal", "the worker failed this call")),
    Sync(10),
    Models((MODEL,), ready=False, default_model="mha"),
    Welcome((MODEL,), ready=True, default_model="mha"),
]


@pytest.mark.parametrize("message", EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_kind_reads_back_as_it_was_written(message: Message) -> None:
    assert codec.decode(codec.encode(message)) == message


def test_a_hello_reads_back_as_it_was_written() -> None:
    hello = Hello(name="frontend-3", pid=4242)
    assert codec.encode(hello) == b'{"name":"frontend-3","pid":4242}'
    assert codec.decode_hello(codec.encode(hello)) == hello


@pytest.mark.parametrize(
    ("name", "message"), [("infer-traced.msg", INFER_TRACED), ("done-traced.msg", DONE_TRACED)]
)
def test_traced_messages_are_packed_as_the_golden_files(name: str, message: Message) -> None:
    body = codec.encode(message)
    assert body == (GOLDEN / name).read_bytes()
    assert codec.decode(body) == message


@pytest.mark.parametrize(
    "message",
    [
        INFER,
        DONE,
        dataclasses.replace(OUTPUT_ONLY, deadline=None),
        OUTPUT_ONLY,
        INFER_TRACED,
        DONE_TRACED,
    ],
    ids=["infer", "done", "infer-no-deadline", "infer-output-only", "traced", "traced-batch"],
)
def test_a_request_s_messages_travel_packed(message: Message) -> None:
    body = codec.encode(message)
    assert packed.is_packed(body)
    assert codec.decode(body) == message


@pytest.mark.parametrize(
    "message",
    [
        dataclasses.replace(INFER, input_offset=None, input_ref=REGION),
        dataclasses.replace(INFER, shape=(16, 512)),
        dataclasses.replace(INFER, model_key="m\ud800/1"),
        dataclasses.replace(INFER, model_key="m" * (packed.MAX_KEY_BYTES + 1)),
        dataclasses.replace(INFER, request_id=2**64),
        dataclasses.replace(DONE, tags=((2**128, 1, 1),)),
        dataclasses.replace(DONE, batch_id=-(2**63) - 1),
    ],
    ids=[
        "client-region",
        "two-dims",
        "not-utf-8",
        "key-too-long",
        "id-too-wide",
        "tag-too-wide",
        "batch-id-too-wide",
    ],
)
def test_what_the_packed_layout_has_no_field_for_goes_as_json(message: Message) -> None:
    body = codec.encode(message)
    assert body.startswith(b"{")
    assert codec.decode(body) == message


# The JSON the Go gateway writes or reads (service/gateway/worker.go, shm.go): these keys, in
# the order the Python side has always written them.
REF = '["r",0,64,"input \'embeddings\'","<f4"]'


@pytest.mark.parametrize(
    ("message", "json_text"),
    [
        (
            dataclasses.replace(OUTPUT_ONLY, input_offset=None, input_ref=REGION, tag=(1, 2, 1)),
            '{"t":"infer","model":"mha/1","w":false,"shape":[2,16,512],"dtype":"<f4",'
            f'"out":65536,"iref":{REF},"deadline":812.5,"tag":[1,2,1],"id":41}}',
        ),
        (
            dataclasses.replace(OUTPUT_ONLY, output_offset=None, output_ref=REGION, deadline=None),
            '{"t":"infer","model":"mha/1","w":false,"shape":[2,16,512],"dtype":"<f4",'
            f'"in":0,"oref":{REF},"deadline":null,"tag":null,"id":41}}',
        ),
        (Cancel(3), '{"t":"cancel","id":3}'),
        (
            Call(4, "load", {"name": "m", "peer": ""}),
            '{"t":"call","id":4,"op":"load","args":{"name":"m","peer":""}}',
        ),
        (Synced(5), '{"t":"synced","id":5}'),
        (
            dataclasses.replace(DONE, tags=((2**128, 1, 1),)),
            '{"t":"done","id":41,"q":0.002,"c":0.0005,"b":6,"s":811.25,"p":0.125,"i":9,'
            f'"tags":[[{2**128},1,1]]}}',
        ),
        (
            Fail(6, ErrorText("Cancelled", "gone")),
            '{"t":"fail","id":6,"kind":"Cancelled","msg":"gone"}',
        ),
        (Reply(7, result={"a": [1]}), '{"t":"reply","id":7,"ok":{"a":[1]}}'),
        (Reply(8), '{"t":"reply","id":8,"ok":null}'),
        (
            Reply(9, error=ErrorText("Internal", "x")),
            '{"t":"reply","id":9,"kind":"Internal","msg":"x"}',
        ),
        (Sync(10), '{"t":"sync","id":10}'),
        (
            Welcome((MODEL,), ready=True, default_model="mha"),
            '{"t":"welcome","models":[{"key":"mha/1","name":"mha","version":1,"embed_dim":512,'
            '"num_heads":8,"causal":false,"dtype":"float32","weights_sha256":"ab12",'
            '"weights_source":"seeded","provider":"CPUExecutionProvider",'
            '"caps":[[16,8],[128,2]],"has_weights_graph":true}],"ready":true,"default_model":"mha"}',
        ),
        (
            Models((), ready=False, default_model=""),
            '{"t":"models","models":[],"ready":false,"default_model":""}',
        ),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, str) else "",
)
def test_json_messages_keep_the_wire_s_keys(message: Message, json_text: str) -> None:
    assert codec.encode(message) == json_text.encode()
    assert codec.decode(json_text.encode()) == message


def test_the_gateway_s_json_infer_reads_as_the_front_end_s() -> None:
    """Go writes a map: keys sorted, no deadline or tag when there is none."""
    body = (
        b'{"dtype":"<f4","id":41,"iref":["r",0,64,"input \'embeddings\'","<f4"],'
        b'"model":"mha/1","out":65536,"shape":[2,16,512],"t":"infer","w":false}'
    )
    expected = dataclasses.replace(OUTPUT_ONLY, input_offset=None, input_ref=REGION, deadline=None)
    assert codec.decode(body) == expected


INFER_JSON = '"t":"infer","id":1,"model":"m/1","w":false,"shape":[1,2,3],"dtype":"<f4"'


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "neither packed nor JSON"),
        (b"not json", "neither packed nor JSON"),
        (b"\xff{}", "neither packed nor JSON"),
        (b"[1, 2]", "a JSON object, got list"),
        (b'{"id":1}', "unknown type None"),
        (b'{"t":"nope","id":1}', "unknown type 'nope'"),
        (b'{"t":"infer","id":1}', "INFER message without 'model' \\(a string\\)"),
        (b'{"t":"cancel","id":"1"}', "CANCEL message: 'id' should be an integer, got '1'"),
        (b'{"t":"sync","id":true}', "SYNC message: 'id' should be an integer, got True"),
        (("{" + INFER_JSON.replace("false", "1") + "}").encode(), "'w' should be true or false"),
        (
            ("{" + INFER_JSON.replace("[1,2,3]", "[1,2.5]") + "}").encode(),
            "'shape' should be an array of integers",
        ),
        (
            ("{" + INFER_JSON + ',"tag":["00f067aa0ba902b7",1]}').encode(),
            "'tag' should be \\[trace id, span id, flags\\]",
        ),
        (
            ("{" + INFER_JSON + ',"iref":["r",0,"64","x","<f4"]}').encode(),
            "'iref' should be \\[region, offset, byte size, where, dtype\\]",
        ),
        (
            ("{" + INFER_JSON + ',"deadline":"soon"}').encode(),
            "'deadline' should be a number, got 'soon'",
        ),
        (
            ("{" + INFER_JSON + ',"in":"x' + "x" * 100 + '"}').encode(),
            "'in' should be an integer, got 'xxxx.*\\.\\.\\.$",
        ),
        (
            b'{"t":"done","id":1,"q":0,"c":0,"b":1,"s":0,"p":0,"i":1,"tags":[["4bf9",1]]}',
            "DONE message: a row of 'tags' should be",
        ),
        (
            b'{"t":"done","id":1,"q":0,"c":0,"b":1,"s":0,"p":0,"i":1}',
            "DONE message without 'tags' \\(an array\\)",
        ),
        (b'{"t":"fail","id":1,"kind":"QueueFull"}', "FAIL message without 'msg'"),
        (b'{"t":"reply","id":1}', "REPLY message with neither 'ok' nor 'kind'"),
        (b'{"t":"call","id":1,"op":"index","args":[]}', "CALL message: 'args' should be an object"),
        (
            b'{"t":"models","models":[{"key":"m/1"}],"ready":true,"default_model":"m"}',
            "MODELS message: a model that does not read",
        ),
        (
            b'{"t":"welcome","models":[],"ready":1,"default_model":"m"}',
            "WELCOME message: 'ready' should be true or false",
        ),
    ],
)
def test_malformed_json_says_what_is_wrong(body: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        codec.decode(body)


@pytest.mark.parametrize(
    ("cut", "says"),
    [
        (lambda body: body[:-3], "packed INFER of .* bytes, its lengths say otherwise"),
        (lambda body: body[:20], "malformed packed message"),
        (lambda body: body + b"x" * packed.TAG.size, "its lengths say otherwise"),
    ],
    ids=["dtype-cut-short", "head-cut-short", "two-tags"],
)
def test_a_malformed_packed_infer_says_what_is_wrong(
    cut: Callable[[bytes], bytes], says: str
) -> None:
    body = cut(codec.encode(INFER_TRACED))
    with pytest.raises(ValueError, match=says):
        codec.decode(body)


def test_a_malformed_packed_done_says_what_is_wrong() -> None:
    body = codec.encode(DONE_TRACED)
    with pytest.raises(ValueError, match="its lengths say otherwise"):
        codec.decode(body[:-1])  # a tag cut short
    with pytest.raises(ValueError, match="malformed packed DONE"):
        codec.decode(body[:30])
    with pytest.raises(ValueError, match="a packed DONE starts with 2"):
        packed.unpack_done(codec.encode(INFER))


def test_a_hello_without_its_pid_says_so() -> None:
    with pytest.raises(ValueError, match="HELLO message without 'pid'"):
        codec.decode_hello(b'{"name":"frontend-0"}')
