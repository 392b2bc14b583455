"""Write service/gateway/wire_gen.go: the words and numbers the gateway's Go shares with the
Python processes it talks to, taken from the Python that defines them.

- the control messages' JSON words (service/ipc/keys.py), as constants, and as the struct
  types the gateway decodes the worker's JSON messages into (json tags must be literals);
- the packed layouts' kinds, sizes and field offsets (service/ipc/packed.py's struct
  layouts), the span record's (service/ipc/span_record.py) and the largest control message
  (service/ipc/channel.py);
- the worker's error kinds (service/ipc/messages.py) and the status code each gets, as
  service/frontend/status.py maps them; gRPC's status codes and names (grpc.StatusCode);
- the metric label names the gateway writes (service/observability/metrics.py's metrics and
  prometheus-client's histogram bucket label) and the api label's values (metrics.Api).

scripts/go_contract.py writes it with the other generated Go (make proto) and checks it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import grpc
from prometheus_client import Histogram

from service.frontend.status import code_for
from service.ipc import channel, messages, packed, span_record
from service.ipc.keys import Key, MessageType, ModelKey, words
from service.observability import metrics

# Go spells these initialisms in capitals (RequestID, codeOK, apiV2).
INITIALISMS = {"id": "ID", "ok": "OK", "api": "API"}
# The keys the gateway reads from the worker's JSON messages, by their keys.Key name, with
# the Go type it reads each as: the fields of the generated workerMessage.
WORKER_MESSAGE = {
    "TYPE": "string",
    "ID": "uint64",
    "ERROR_KIND": "string",
    "ERROR_MESSAGE": "string",
    "QUEUE_S": "float64",
    "COMPUTE_S": "float64",
    "BATCH_SIZE": "int64",
    "MODELS": "[]*modelInfo",
    "DEFAULT_MODEL": "string",
    "READY": "bool",
}
# The keys of a served version the gateway reads (keys.ModelKey): the fields of modelInfo.
MODEL_INFO = {
    "KEY": "string",
    "NAME": "string",
    "VERSION": "int64",
    "EMBED_DIM": "int64",
    "NUM_HEADS": "int64",
    "DTYPE": "string",
    "HAS_WEIGHTS_GRAPH": "bool",
}
# The metrics the gateway writes series of (metrics.go, restricted.go).
GATEWAY_METRICS = (
    metrics.REQUESTS,
    metrics.REQUEST_DURATION,
    metrics.IN_FLIGHT,
    metrics.UNDELIVERED_REFUSALS,
    metrics.RESTRICTED_DENIALS,
)
# The struct codes the gateway reads and writes packed fields as, by their size; a layout
# with any other would need Go written for it.
PACKED_CODES = set("BQ?qdH") | {"16s", "8s"}
SOURCES = (
    "service/ipc/keys.py, packed.py, span_record.py, channel.py and messages.py, "
    "service/frontend/status.py, grpc.StatusCode and service/observability/metrics.py"
)


def go_name(name: str, prefix: str = "") -> str:
    """A Python NAME (or name) as a Go name after prefix: ("queue_s", "done") -> doneQueueS;
    without a prefix, exported: ERROR_KIND -> ErrorKind."""
    parts = [INITIALISMS.get(part, part.title()) for part in name.lower().split("_")]
    return prefix + "".join(parts)


def comment_lines(text: str) -> list[str]:
    """text as // lines (a line of text for each)."""
    return [f"// {line}" for line in text.splitlines()]


def const_block(constants: Mapping[str, object], comment: str) -> list[str]:
    """A Go const block, aligned as gofmt aligns it; strings quoted."""
    width = max(map(len, constants))
    values = {
        name: json.dumps(value) if isinstance(value, str) else str(value)
        for name, value in constants.items()
    }
    return [
        *comment_lines(comment),
        "const (",
        *(f"\t{name:<{width}} = {value}" for name, value in values.items()),
        ")",
        "",
    ]


def _struct(name: str, comment: str, fields: Mapping[str, tuple[str, str]]) -> list[str]:
    """A Go struct type of exported fields, Go name -> (Go type, JSON key), gofmt'd."""
    name_width = max(map(len, fields))
    type_width = max(len(go_type) for go_type, _ in fields.values())
    return [
        *comment_lines(comment),
        f"type {name} struct {{",
        *(
            f"\t{field:<{name_width}} {go_type:<{type_width}} `json:{json.dumps(key)}`"
            for field, (go_type, key) in fields.items()
        ),
        "}",
        "",
    ]


def _map(declaration: str, comment: str, entries: Mapping[str, str]) -> list[str]:
    """A Go map literal, one entry a line, its values aligned as gofmt aligns them."""
    width = max(map(len, entries)) + 1
    return [
        *comment_lines(comment),
        f"var {declaration}{{",
        *(f"\t{key + ':':<{width}} {value}," for key, value in entries.items()),
        "}",
        "",
    ]


def offsets(fields: Mapping[str, str], byte_order: str) -> dict[str, int]:
    """Where each field of a packed layout starts: the size of the fields before it."""
    codes = list(fields.values())
    assert set(codes) <= PACKED_CODES, f"a struct code the gateway has no Go for: {codes}"
    return {name: struct.calcsize(byte_order + "".join(codes[:i])) for i, name in enumerate(fields)}


def _layout(prefix: str, fields: Mapping[str, str], layout: struct.Struct) -> dict[str, int]:
    assert layout.format == "<" + "".join(fields.values()), f"{prefix}: not its fields' layout"
    return {go_name(name, f"{prefix}At"): at for name, at in offsets(fields, "<").items()}


def packed_constants() -> dict[str, int]:
    assert packed.TAG.format.startswith(">"), "a tag's ids are big-endian, as Go writes them"
    return {
        "inferKind": packed.INFER_KIND,
        "doneKind": packed.DONE_KIND,
        "inferHeadSize": packed.INFER.size,
        "doneSize": packed.DONE.size,
        "tagSize": packed.TAG.size,
        "spanRecordVersion": span_record.VERSION,
        "spanHeadSize": span_record.HEAD.size,
        "maxMessage": channel.MAX_MESSAGE_BYTES,
    }


def status_codes() -> dict[str, int]:
    """Every gRPC status code by its Go name: codeOK, codeInvalidArgument, ..."""
    return {go_name(code.name, "code"): code.value[0] for code in grpc.StatusCode}


def error_kinds() -> dict[str, str]:
    """The worker's error kinds by their Go names: those a front end rebuilds, and the two
    it does not (INTERNAL for the client; a cancelled request's)."""
    kinds = [*messages.ERRORS, messages.INTERNAL, messages.CANCELLED]
    return {f"kind{kind}": kind for kind in kinds}


def kind_codes() -> dict[str, int]:
    """Each kind a front end rebuilds, with the status Python answers its error with."""
    return {kind: code_for(error("")).value[0] for kind, error in messages.ERRORS.items()}


def label_names() -> dict[str, str]:
    """The label names of the gateway's series, bucket label included, by their Go names."""
    names = [name for metric in GATEWAY_METRICS for name in metric._labelnames]
    names += Histogram._reserved_labelnames
    return {go_name(name, "label"): name for name in dict.fromkeys(names)}


def render() -> str:
    code_names = {code: go_name(code.name, "code") for code in grpc.StatusCode}
    by_number = {number: name for name, number in status_codes().items()}
    lines = [
        f"// Code generated by scripts/go_wire_contract.py from {SOURCES}; DO NOT EDIT.",
        "",
        "package main",
        "",
        *const_block(
            {go_name(name, "message"): value for name, value in words(MessageType).items()},
            "The control messages' types, as the worker reads and writes them (keys.MessageType).",
        ),
        *const_block(
            {go_name(name, "key"): value for name, value in words(Key).items()},
            "The keys of their JSON objects (keys.Key).",
        ),
        *_struct(
            "workerMessage",
            "workerMessage is a JSON message from the worker: the keys the gateway reads.",
            {
                go_name(name): (go_type, getattr(Key, name))
                for name, go_type in WORKER_MESSAGE.items()
            },
        ),
        *_struct(
            "modelInfo",
            "modelInfo is one served version, as the worker reports it (keys.ModelKey).",
            {
                go_name(name): (go_type, getattr(ModelKey, name))
                for name, go_type in MODEL_INFO.items()
            },
        ),
        *const_block(
            packed_constants(),
            "The packed messages' kinds and sizes (packed.py), the span record's\n"
            "(span_record.py), the largest control message (channel.py).",
        ),
        *const_block(
            _layout("infer", packed.INFER_FIELDS, packed.INFER),
            "Where each field of a packed INFER starts (packed.INFER_FIELDS); little-endian.",
        ),
        *const_block(
            _layout("done", packed.DONE_FIELDS, packed.DONE),
            "Where each field of a packed DONE starts (packed.DONE_FIELDS); little-endian.",
        ),
        *const_block(error_kinds(), "The worker's error kinds (service/ipc/messages.py)."),
        *const_block(status_codes(), "gRPC's status codes (grpc.StatusCode)."),
        *_map(
            "codeNames = map[int]string",
            "Each status code's name, as the metrics label it.",
            {name: json.dumps(code.name) for code, name in code_names.items()},
        ),
        *_map(
            "kindCodes = map[string]int",
            "The status of each error kind a front end rebuilds, as service/frontend/status.py\n"
            "maps it; any other kind is INTERNAL.",
            {f"kind{kind}": by_number[code] for kind, code in kind_codes().items()},
        ),
        *const_block(label_names(), "The label names of the gateway's series (metrics.py)."),
        *const_block(
            {go_name(name, "api"): value for name, value in words(metrics.Api).items()},
            "The api label's values (metrics.Api).",
        ),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
