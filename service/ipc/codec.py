"""Control messages to bytes and back, in one place: encode() gives a record's body, packed
(packed.py) where its layout fits and a JSON object otherwise; decode() gives the record a
body holds, or a ValueError that says what is wrong with it.

The JSON objects keep the wire's short keys (keys.py: Key.TYPE the message type, Key.ID, ...):
the Go gateway writes and reads the same bytes (service/gateway/worker.go, shm.go, with the
words generated from keys.py), so they are written in the order the front end and worker
always wrote them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from service.dataplane import RegionRef
from service.ipc import messages, packed
from service.ipc.fields import Fields, is_integer, shown_value
from service.ipc.keys import Key, MessageType
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
    kind = data.get(Key.TYPE)
    if not isinstance(kind, str) or kind not in _READERS:
        raise ValueError(f"control message of unknown type {shown_value(kind)}")
    return _READERS[kind](Fields(data, kind.upper()))


def decode_hello(body: bytes | bytearray) -> Hello:
    """The first message on a link: who connects."""
    fields = Fields(_json_object(body), "HELLO")
    return Hello(name=fields.text(Key.NAME), pid=fields.integer(Key.PID))


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
    return {Key.NAME: message.name, Key.PID: message.pid}


@_json_form.register
def _(message: InferRequest) -> dict[str, Any]:
    data: dict[str, Any] = {
        Key.TYPE: MessageType.INFER,
        Key.MODEL: message.model_key,
        Key.WITH_WEIGHTS: message.with_weights,
        Key.SHAPE: list(message.shape),
        Key.DTYPE: message.dtype,
    }
    for key, offset in (
        (Key.INPUT_OFFSET, message.input_offset),
        (Key.OUTPUT_OFFSET, message.output_offset),
        (Key.WEIGHTS_OFFSET, message.weights_offset),
    ):
        if offset is not None:
            data[key] = offset
    for key, ref in (
        (Key.INPUT_REF, message.input_ref),
        (Key.OUTPUT_REF, message.output_ref),
        (Key.WEIGHTS_REF, message.weights_ref),
    ):
        if ref is not None:
            data[key] = _ref_form(ref)
    tag = message.tag
    data[Key.DEADLINE] = message.deadline
    data[Key.TAG] = None if tag is None else list(tag)
    data[Key.ID] = message.request_id
    return data


@_json_form.register
def _(message: Cancel) -> dict[str, Any]:
    return {Key.TYPE: MessageType.CANCEL, Key.ID: message.request_id}


@_json_form.register
def _(message: Call) -> dict[str, Any]:
    return {
        Key.TYPE: MessageType.CALL,
        Key.ID: message.call_id,
        Key.OP: message.op,
        Key.ARGS: message.args,
    }


@_json_form.register
def _(message: Synced) -> dict[str, Any]:
    return {Key.TYPE: MessageType.SYNCED, Key.ID: message.sync_id}


@_json_form.register
def _(message: Done) -> dict[str, Any]:
    return {
        Key.TYPE: MessageType.DONE,
        Key.ID: message.request_id,
        Key.QUEUE_S: message.queue_s,
        Key.COMPUTE_S: message.compute_s,
        Key.BATCH_SIZE: message.batch_size,
        Key.STARTED_AT: message.started_at,
        Key.PADDING: message.padding,
        Key.BATCH_ID: message.batch_id,
        Key.TAGS: [list(tag) for tag in message.tags],
    }


@_json_form.register
def _(message: Fail) -> dict[str, Any]:
    return {Key.TYPE: MessageType.FAIL, Key.ID: message.request_id, **_error_form(message.error)}


@_json_form.register
def _(message: Reply) -> dict[str, Any]:
    if message.error is not None:
        return {Key.TYPE: MessageType.REPLY, Key.ID: message.call_id, **_error_form(message.error)}
    return {Key.TYPE: MessageType.REPLY, Key.ID: message.call_id, Key.RESULT: message.result}


@_json_form.register
def _(message: Sync) -> dict[str, Any]:
    return {Key.TYPE: MessageType.SYNC, Key.ID: message.sync_id}


@_json_form.register
def _(message: Models) -> dict[str, Any]:
    return {
        Key.TYPE: MessageType.WELCOME if isinstance(message, Welcome) else MessageType.MODELS,
        Key.MODELS: [messages.model_to_json(model) for model in message.models],
        Key.READY: message.ready,
        Key.DEFAULT_MODEL: message.default_model,
    }


def _ref_form(tensor: ClientTensor) -> list[Any]:
    ref = tensor.ref
    return [ref.region, ref.offset, ref.byte_size, ref.where, tensor.dtype]


def _error_form(error: ErrorText) -> dict[str, str]:
    return {Key.ERROR_KIND: error.kind, Key.ERROR_MESSAGE: error.message}


# -- JSON -> records ---------------------------------------------------------------------------


def _read_infer(fields: Fields) -> InferRequest:
    tag = fields.data.get(Key.TAG)
    return InferRequest(
        request_id=fields.integer(Key.ID),
        model_key=fields.text(Key.MODEL),
        with_weights=fields.flag(Key.WITH_WEIGHTS),
        shape=fields.integers(Key.SHAPE),
        dtype=fields.text(Key.DTYPE),
        deadline=fields.optional_number(Key.DEADLINE),
        input_offset=fields.optional_integer(Key.INPUT_OFFSET),
        output_offset=fields.optional_integer(Key.OUTPUT_OFFSET),
        weights_offset=fields.optional_integer(Key.WEIGHTS_OFFSET),
        tag=None if tag is None else _trace_tag(tag, fields.kind, repr(Key.TAG)),
        input_ref=_client_tensor(fields, Key.INPUT_REF),
        output_ref=_client_tensor(fields, Key.OUTPUT_REF),
        weights_ref=_client_tensor(fields, Key.WEIGHTS_REF),
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
    rows = fields.array(Key.TAGS)
    return Done(
        request_id=fields.integer(Key.ID),
        queue_s=fields.number(Key.QUEUE_S),
        compute_s=fields.number(Key.COMPUTE_S),
        batch_size=fields.integer(Key.BATCH_SIZE),
        started_at=fields.number(Key.STARTED_AT),
        padding=fields.number(Key.PADDING),
        batch_id=fields.integer(Key.BATCH_ID),
        tags=tuple(_trace_tag(row, fields.kind, f"a row of {Key.TAGS!r}") for row in rows),
    )


def _read_error(fields: Fields) -> ErrorText:
    return ErrorText(kind=fields.text(Key.ERROR_KIND), message=fields.text(Key.ERROR_MESSAGE))


def _read_reply(fields: Fields) -> Reply:
    call_id = fields.integer(Key.ID)
    if Key.ERROR_KIND in fields.data:
        return Reply(call_id, error=_read_error(fields))
    if Key.RESULT not in fields.data:
        raise ValueError(
            f"{fields.kind} message with neither {Key.RESULT!r} nor {Key.ERROR_KIND!r}"
        )
    return Reply(call_id, result=fields.data[Key.RESULT])


def _read_models(fields: Fields) -> Models:
    try:
        models = tuple(messages.model_from_json(data) for data in fields.array(Key.MODELS))
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ValueError(f"{fields.kind} message: a model that does not read: {err!r}") from err
    kind = Welcome if fields.kind == MessageType.WELCOME.upper() else Models
    return kind(models, ready=fields.flag(Key.READY), default_model=fields.text(Key.DEFAULT_MODEL))


_READERS: dict[str, Callable[[Fields], Message]] = {
    MessageType.INFER: _read_infer,
    MessageType.CANCEL: lambda fields: Cancel(fields.integer(Key.ID)),
    MessageType.CALL: lambda fields: Call(
        fields.integer(Key.ID), fields.text(Key.OP), fields.obj(Key.ARGS)
    ),
    MessageType.SYNCED: lambda fields: Synced(fields.integer(Key.ID)),
    MessageType.DONE: _read_done,
    MessageType.FAIL: lambda fields: Fail(fields.integer(Key.ID), _read_error(fields)),
    MessageType.REPLY: _read_reply,
    MessageType.SYNC: lambda fields: Sync(fields.integer(Key.ID)),
    MessageType.MODELS: _read_models,
    MessageType.WELCOME: _read_models,
}
