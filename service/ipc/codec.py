"""Control messages to bytes and back, in one place: encode() gives a record's body, packed
(packed.py) where its layout fits and a JSON object otherwise; decode() gives the record a
body holds, or a ValueError that says what is wrong with it.

The JSON objects keep the wire's short keys ("t" the message type, "id", "w", "q", ...):
the Go gateway writes and reads the same bytes (service/gateway/worker.go, shm.go), so they
are written in the order the front end and worker always wrote them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from service.dataplane import RegionRef
from service.ipc import messages, packed
from service.ipc.fields import Fields, is_integer, shown_value
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
    TraceTag,
    Welcome,
)

# Message types, as "t" names them.
INFER, CANCEL, CALL, SYNCED = "infer", "cancel", "call", "synced"  # front end -> worker
DONE, FAIL, REPLY, SYNC = "done", "fail", "reply", "sync"  # worker -> front end
MODELS, WELCOME = "models", "welcome"
_COMPACT = (",", ":")


def encode(message: Message | Hello) -> bytes:
    """The message's body (without its length)."""
    body: bytes | None = None
    if isinstance(message, InferRequest):
        body = packed.pack_infer(message)
    elif isinstance(message, Done):
        body = packed.pack_done(message)
    if body is None:
        body = json.dumps(_json_form(message), separators=_COMPACT).encode()
    return body


def decode(body: bytes | bytearray) -> Message:
    """The record a body holds; ValueError, naming what is wrong, when it is malformed."""
    if packed.is_packed(body):
        return packed.unpack(body)
    data = _json_object(body)
    kind = data.get("t")
    if not isinstance(kind, str) or kind not in _READERS:
        raise ValueError(f"control message of unknown type {shown_value(kind)}")
    return _READERS[kind](Fields(data, kind.upper()))


def decode_hello(body: bytes | bytearray) -> Hello:
    """The first message on a link: who connects."""
    fields = Fields(_json_object(body), "HELLO")
    return Hello(name=fields.text("name"), pid=fields.integer("pid"))


def _json_object(body: bytes | bytearray) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"control message is neither packed nor JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"a control message is a JSON object, got {type(data).__name__}")
    return data


# -- records -> JSON ---------------------------------------------------------------------------


@functools.singledispatch
def _json_form(message: object) -> dict[str, Any]:
    raise TypeError(f"{type(message).__name__} is not a control message")


@_json_form.register
def _(message: Hello) -> dict[str, Any]:
    return {"name": message.name, "pid": message.pid}


@_json_form.register
def _(message: InferRequest) -> dict[str, Any]:
    data: dict[str, Any] = {
        "t": INFER,
        "model": message.model_key,
        "w": message.with_weights,
        "shape": list(message.shape),
        "dtype": message.dtype,
    }
    for key, offset in (
        ("in", message.input_offset),
        ("out", message.output_offset),
        ("wout", message.weights_offset),
    ):
        if offset is not None:
            data[key] = offset
    for key, ref in (
        ("iref", message.input_ref),
        ("oref", message.output_ref),
        ("wref", message.weights_ref),
    ):
        if ref is not None:
            data[key] = _ref_form(ref)
    tag = message.tag
    data.update(deadline=message.deadline, tag=None if tag is None else list(tag))
    data["id"] = message.request_id
    return data


@_json_form.register
def _(message: Cancel) -> dict[str, Any]:
    return {"t": CANCEL, "id": message.request_id}


@_json_form.register
def _(message: Call) -> dict[str, Any]:
    return {"t": CALL, "id": message.call_id, "op": message.op, "args": message.args}


@_json_form.register
def _(message: Synced) -> dict[str, Any]:
    return {"t": SYNCED, "id": message.sync_id}


@_json_form.register
def _(message: Done) -> dict[str, Any]:
    return {
        "t": DONE,
        "id": message.request_id,
        "q": message.queue_s,
        "c": message.compute_s,
        "b": message.batch_size,
        "s": message.started_at,
        "p": message.padding,
        "i": message.batch_id,
        "tags": [list(tag) for tag in message.tags],
    }


@_json_form.register
def _(message: Fail) -> dict[str, Any]:
    return {"t": FAIL, "id": message.request_id, **_error_form(message.error)}


@_json_form.register
def _(message: Reply) -> dict[str, Any]:
    if message.error is not None:
        return {"t": REPLY, "id": message.call_id, **_error_form(message.error)}
    return {"t": REPLY, "id": message.call_id, "ok": message.result}


@_json_form.register
def _(message: Sync) -> dict[str, Any]:
    return {"t": SYNC, "id": message.sync_id}


@_json_form.register
def _(message: Models) -> dict[str, Any]:
    return {
        "t": WELCOME if isinstance(message, Welcome) else MODELS,
        "models": [messages.model_to_json(model) for model in message.models],
        "ready": message.ready,
        "default_model": message.default_model,
    }


def _ref_form(tensor: ClientTensor) -> list[Any]:
    ref = tensor.ref
    return [ref.region, ref.offset, ref.byte_size, ref.where, tensor.dtype]


def _error_form(error: ErrorText) -> dict[str, str]:
    return {"kind": error.kind, "msg": error.message}


# -- JSON -> records ---------------------------------------------------------------------------


def _read_infer(fields: Fields) -> InferRequest:
    tag = fields.data.get("tag")
    return InferRequest(
        request_id=fields.integer("id"),
        model_key=fields.text("model"),
        with_weights=fields.flag("w"),
        shape=fields.integers("shape"),
        dtype=fields.text("dtype"),
        deadline=fields.optional_number("deadline"),
        input_offset=fields.optional_integer("in"),
        output_offset=fields.optional_integer("out"),
        weights_offset=fields.optional_integer("wout"),
        tag=None if tag is None else _trace_tag(tag, fields.kind, "'tag'"),
        input_ref=_client_tensor(fields, "iref"),
        output_ref=_client_tensor(fields, "oref"),
        weights_ref=_client_tensor(fields, "wref"),
    )


def _trace_tag(row: object, kind: str, where: str) -> TraceTag:
    if not (isinstance(row, list) and len(row) == 3 and all(is_integer(x) for x in row)):
        raise ValueError(
            f"{kind} message: {where} should be [trace id, span id, flags] (integers), got "
            f"{shown_value(row)}"
        )
    trace_id, span_id, flags = row
    return (trace_id, span_id, flags)


def _client_tensor(fields: Fields, key: str) -> ClientTensor | None:
    """A reference as INFER carries it: [region, offset, byte_size, where, dtype]."""
    ref = fields.data.get(key)
    if ref is None:
        return None
    if isinstance(ref, list) and len(ref) == 5:
        region, offset, byte_size, where, dtype = ref
        texts = (region, where, dtype)
        if all(isinstance(t, str) for t in texts) and is_integer(offset) and is_integer(byte_size):
            return ClientTensor(RegionRef(region, offset, byte_size, where), dtype)
    raise ValueError(
        f"{fields.kind} message: {key!r} should be [region, offset, byte size, where, dtype], "
        f"got {shown_value(ref)}"
    )


def _read_done(fields: Fields) -> Done:
    rows = fields.array("tags")
    return Done(
        request_id=fields.integer("id"),
        queue_s=fields.number("q"),
        compute_s=fields.number("c"),
        batch_size=fields.integer("b"),
        started_at=fields.number("s"),
        padding=fields.number("p"),
        batch_id=fields.integer("i"),
        tags=tuple(_trace_tag(row, fields.kind, "a row of 'tags'") for row in rows),
    )


def _read_error(fields: Fields) -> ErrorText:
    return ErrorText(kind=fields.text("kind"), message=fields.text("msg"))


def _read_reply(fields: Fields) -> Reply:
    call_id = fields.integer("id")
    if "kind" in fields.data:
        return Reply(call_id, error=_read_error(fields))
    if "ok" not in fields.data:
        raise ValueError(f"{fields.kind} message with neither 'ok' nor 'kind'")
    return Reply(call_id, result=fields.data["ok"])


def _read_models(fields: Fields) -> Models:
    try:
        models = tuple(messages.model_from_json(data) for data in fields.array("models"))
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ValueError(f"{fields.kind} message: a model that does not read: {err!r}") from err
    kind = Welcome if fields.kind == WELCOME.upper() else Models
    return kind(models, ready=fields.flag("ready"), default_model=fields.text("default_model"))


_READERS: dict[str, Callable[[Fields], Message]] = {
    INFER: _read_infer,
    CANCEL: lambda fields: Cancel(fields.integer("id")),
    CALL: lambda fields: Call(fields.integer("id"), fields.text("op"), fields.obj("args")),
    SYNCED: lambda fields: Synced(fields.integer("id")),
    DONE: _read_done,
    FAIL: lambda fields: Fail(fields.integer("id"), _read_error(fields)),
    REPLY: _read_reply,
    SYNC: lambda fields: Sync(fields.integer("id")),
    MODELS: _read_models,
    WELCOME: _read_models,
}
