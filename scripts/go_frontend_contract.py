"""Write service/gateway/frontend_gen.go: what a front end hands its gateway, and what the
gateway hands back, taken from the Python that defines it.

- the headers that name a call's client to Python (service/frontend/caller.py), in net/http's
  canonical spelling;
- the environment variables the front end starts the gateway with, and the JSON they carry
  (service/frontend/gateway.py: metrics_spec(), the series the gateway writes, as the struct
  types the gateway decodes it into; service/frontend/restricted.py's for_gateway(), the
  restrictions it checks, likewise);
- the multiprocess files its series go in, named by their kinds as prometheus-client names a
  process's files (service/observability/metrics.py's metrics; tests/golden/metrics/ holds
  the bytes prometheus-client writes, which the gateway's Go tests compare), and the values
  of the labels it writes that Python defines (metrics.Scope).

scripts/go_contract.py writes it with the other generated Go (make proto) and checks it.
"""

from __future__ import annotations

import json
from typing import Any

from scripts.go_wire_contract import const_block, go_name
from service.frontend import caller, gateway
from service.frontend.restricted import Key, Restrictions
from service.ipc.keys import words
from service.observability import metrics

SOURCES = (
    "service/frontend/caller.py, gateway.py and restricted.py and service/observability/metrics.py"
)
# The Go type of each part of metrics_spec(), by its keys (in their order), and what it is.
SPEC_TYPES = {
    ("family", "sample", "help"): "metricSpec",
    ("family", "help", "bounds", "labels"): "histogramSpec",
}
SPEC_TYPE_COMMENTS = {
    "metricSpec": "metricSpec names and describes a counter or a gauge (its one sample).",
    "histogramSpec": "histogramSpec names and describes a histogram and its buckets.",
}
# A group the gateway checks keys of, to describe a restriction with.
GROUP = gateway.ANSWERED_GROUPS[0]
# What a JSON field holds, where its Go name does not say.
NOTES = {
    "labels": "each bound as prometheus-client writes it",
    "methods": "every method of a restricted group: its group",
    "keys": "the keys of the groups answered here",
    "without": "the message when the call has no such header",
    "wrong": "the message when its value is not the key",
}


def canonical_header(name: str) -> str:
    """A header's name as net/http spells it (textproto.CanonicalMIMEHeaderKey)."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def headers() -> dict[str, str]:
    return {
        "peerHeader": canonical_header(caller.PEER_HEADER),
        "subjectHeader": canonical_header(caller.SUBJECT_HEADER),
        "streamPartHeader": canonical_header(caller.STREAM_PART_HEADER),
    }


def variables() -> dict[str, str]:
    return {
        "metricsVariable": gateway.METRICS_VARIABLE,
        "restrictedFDVariable": gateway.RESTRICTED_FD_VARIABLE,
        "logFDVariable": gateway.LOG_FD_VARIABLE,
    }


def file_prefixes() -> dict[str, str]:
    """The multiprocess files the gateway writes, by what goes in them: a counter's, a
    histogram's, and a livesum gauge's file, named as prometheus-client names them (its
    MultiProcessValue: the type, and a gauge's mode after it)."""
    counters = (metrics.REQUESTS, metrics.UNDELIVERED_REFUSALS, metrics.RESTRICTED_DENIALS)
    assert {metric._type for metric in counters} == {"counter"}, "the gateway's counters"
    live = (metrics.IN_FLIGHT, metrics.UNDELIVERED_BYTES)
    modes = {(metric._type, metric._multiprocess_mode) for metric in live}
    assert modes == {("gauge", "livesum")}, f"the gateway sums its gauges over processes: {modes}"
    return {
        "counterFile": metrics.REQUESTS._type,
        "histogramFile": metrics.REQUEST_DURATION._type,
        "liveGaugeFile": "_".join(modes.pop()),
    }


def scopes() -> dict[str, str]:
    return {go_name(name, "scope"): value for name, value in words(metrics.Scope).items()}


def _go_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    assert isinstance(value, list), f"a JSON value the gateway has no Go for: {value}"
    assert value, "an empty list: no Go type to read it as"
    kinds = {type(item) for item in value}
    assert kinds in ({float}, {str}), f"a list the gateway has no Go for: {value}"
    return "[]float64" if kinds == {float} else "[]string"


Field = tuple[str, str, str]  # Go name, Go type, JSON key


def _struct(name: str, comment: str, fields: list[Field]) -> list[str]:
    """A Go struct type of exported fields, each with its JSON key (and a note), gofmt'd."""
    name_width = max(len(field) for field, _, _ in fields)
    type_width = max(len(go_type) for _, go_type, _ in fields)
    tags = [f"`json:{json.dumps(key)}`" for _, _, key in fields]
    lines = []
    for (field, go_type, key), tag in zip(fields, tags, strict=True):
        line = f"\t{field:<{name_width}} {go_type:<{type_width}} {tag}"
        if key in NOTES:
            # gofmt aligns the comments of a run of commented lines.
            run = [t for t, (_, _, k) in zip(tags, fields, strict=True) if k in NOTES]
            line = f"{line:<{len(line) - len(tag) + max(map(len, run))}} // {NOTES[key]}"
        lines.append(line)
    return [
        *(f"// {line}" for line in comment.splitlines()),
        f"type {name} struct {{",
        *lines,
        "}",
        "",
    ]


def metrics_spec_types() -> list[str]:
    """metricsSpec and the types of its parts, from the JSON metrics_spec() writes."""
    spec = gateway.metrics_spec()
    parts: dict[str, list[Field]] = {}
    fields = []
    for key, part in spec.items():
        type_name = SPEC_TYPES[tuple(part)]
        parts[type_name] = [(go_name(k), _go_type(v), k) for k, v in part.items()]
        fields.append((go_name(key), type_name, key))
    lines = []
    for type_name, part_fields in parts.items():
        lines += _struct(type_name, SPEC_TYPE_COMMENTS[type_name], part_fields)
    return lines + _struct(
        "metricsSpec",
        "metricsSpec is the series the gateway writes, named and described as metrics.py\n"
        "declares them (the JSON of gateway.metrics_spec()).",
        fields,
    )


def restrictions() -> dict[str, Any]:
    """What Restrictions.for_gateway writes for one restricted group."""
    return Restrictions({GROUP: Key("key", "value")}).for_gateway([GROUP])


def restrictions_types() -> list[str]:
    """restrictedKey and restrictionsJSON, from the JSON Restrictions.for_gateway writes."""
    described = restrictions()
    key_fields = [(go_name(k), _go_type(v), k) for k, v in described["keys"][GROUP].items()]
    go_types = {"methods": "map[string]string", "keys": "map[string]*restrictedKey"}
    assert described.keys() == go_types.keys(), f"for_gateway's keys: {list(described)}"
    return [
        *_struct(
            "restrictedKey",
            "restrictedKey is one group's key and its refusals' words (Restrictions.denial).",
            key_fields,
        ),
        *_struct(
            "restrictionsJSON",
            "restrictionsJSON is what Restrictions.for_gateway writes.",
            [(go_name(k), go_types[k], k) for k in described],
        ),
    ]


def render() -> str:
    lines = [
        f"// Code generated by scripts/go_frontend_contract.py from {SOURCES}; DO NOT EDIT.",
        "",
        "package main",
        "",
        *const_block(
            headers(),
            "The headers that tell the Python front end who called (caller.py), as net/http\n"
            "spells them.",
        ),
        *const_block(
            variables(),
            "The environment variables the front end starts the gateway with (gateway.py).",
        ),
        *metrics_spec_types(),
        *const_block(
            file_prefixes(),
            "The multiprocess files of the gateway's series, <kind>_<pid>.db, named as\n"
            "prometheus-client names a process's files of each kind (metrics.py's metrics).",
        ),
        *const_block(scopes(), "The scope label's values (metrics.Scope)."),
        *restrictions_types(),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
