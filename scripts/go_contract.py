"""Write the gateway's generated Go: what the Go gateway and Python must agree on, taken from
the Python that defines it.

- service/gateway/contract_gen.go: the status page's layout and its refusals' words
  (service/ipc/status_page.py), the other status messages both sides write
  (service/status_texts.py), and how a client's string is shown in them (service/text.py);
- service/gateway/proto_gen.go: the field numbers of every message the gateway reads or writes
  by hand (service/gateway/protowire.go), and attention.v1's DataType values, from the
  generated protobuf modules Python serves with;
- service/gateway/defaults_gen.go: the defaults of its flags that Python has a value for, from
  service/settings.py's Settings defaults and the constants of
  service/transport/grpc_options.py, service/dataplane.py and service/frontend/ (the front
  end passes every flag; the defaults serve a gateway started by hand);
- service/gateway/wire_gen.go: the control messages' words, layouts and sizes, the worker's
  error kinds and their status codes, gRPC's codes, the metrics' label names and api values
  (scripts/go_wire_contract.py says from where);
- service/gateway/api_gen.go: the served APIs' names the gateway reads and writes: method
  paths, tensor names, dtypes, tensor parameters, region fields (scripts/go_api_contract.py
  says from where);
- service/gateway/frontend_gen.go: what a front end and its gateway hand each other: the
  caller headers, the environment variables and the JSON they carry (the metrics spec, the
  restrictions), the metrics files' kinds and the scope label's values
  (scripts/go_frontend_contract.py says from where).

    python -m scripts.go_contract            # regenerate in place (make proto runs it)
    python -m scripts.go_contract --check    # exit 1 when a Go file is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from scripts import go_api_contract, go_frontend_contract, go_wire_contract
from service import dataplane, status_texts
from service.frontend import gateway, limits, server
from service.generated.attention.v1 import attention_pb2
from service.generated.inference import grpc_service_pb2
from service.ipc import slab, status_page
from service.settings import Settings
from service.text import SHOWN_CHARS, SHOWN_MORE
from service.transport import grpc_options

GATEWAY = Path(__file__).resolve().parent.parent / "service" / "gateway"
GO_FILE = GATEWAY / "contract_gen.go"
PROTO_GO_FILE = GATEWAY / "proto_gen.go"
DEFAULTS_GO_FILE = GATEWAY / "defaults_gen.go"
WIRE_GO_FILE = GATEWAY / "wire_gen.go"
API_GO_FILE = GATEWAY / "api_gen.go"
FRONTEND_GO_FILE = GATEWAY / "frontend_gen.go"
PLACEHOLDER = re.compile(r"\{(\w+)\}")
# Go spells these initialisms in capitals (RequestID, not RequestId).
INITIALISMS = {"id": "ID"}
# The Go type of a template's placeholders: the type its callers hold them in.
NUMBER_TYPES = {
    "QUEUE_FULL_BY_COUNT": "uint64",
    "QUEUE_FULL_BY_BYTES": "uint64",
    "ANSWERS_BACKLOGGED_BY_SERVER": "int64",
    "ANSWERS_BACKLOGGED_BY_CONNECTION": "int64",
    "SLAB_TOO_SMALL": "int",
    "SLAB_FULL": "int",
    "METADATA_TOO_LARGE": "int",
    "BAD_BINARY_HEADER": "string",
    "BAD_METADATA": "string",
    "ILLEGAL_HEADER_KEY": "string",
    "INTERNAL_ERROR": "string",
    "UNEXPECTED_PAYLOAD_FORMAT": "int",
    "SHOWN_MORE": "int",
}
# The messages the gateway reads or writes by hand, by their Go name (a nested message by its
# own): constants field<Go name><Field>.
V2_MESSAGES = {
    "ModelInferRequest": "ModelInferRequest",
    "InferInputTensor": "ModelInferRequest.InferInputTensor",
    "InferRequestedOutputTensor": "ModelInferRequest.InferRequestedOutputTensor",
    "ModelInferResponse": "ModelInferResponse",
    "InferOutputTensor": "ModelInferResponse.InferOutputTensor",
    "ModelStreamInferResponse": "ModelStreamInferResponse",
    # Every map<string, InferParameter> above: one reader and one writer serve them all.
    "ParametersEntry": "ModelInferRequest.InferInputTensor.ParametersEntry",
    "InferParameter": "InferParameter",
    # The health calls answered here.
    "ServerLiveResponse": "ServerLiveResponse",
    "ServerReadyResponse": "ServerReadyResponse",
    "ModelReadyRequest": "ModelReadyRequest",
    "ModelReadyResponse": "ModelReadyResponse",
}
HEALTH_MESSAGES = ("HealthCheckRequest", "HealthCheckResponse")
ATTENTION_MESSAGES = {
    name: name
    for name in (
        "AttendRequest",
        "Tensor",
        "SharedMemoryRef",
        "AttendResponse",
        "ServerTiming",
        "AttendStreamResponse",
        "StreamError",
    )
}


def _camel(name: str, *, upper: bool = False) -> str:
    head, *rest = name.lower().split("_")
    parts = [INITIALISMS.get(part, part.title()) for part in rest]
    return (INITIALISMS.get(head, head.title()) if upper else head) + "".join(parts)


def _formatter(module: str, name: str, template: str) -> str:
    """A Go function that formats template (integer placeholders) as Python's str.format."""
    fields = PLACEHOLDER.findall(template)
    args = ", ".join(_camel(field) for field in fields)
    verb = "%s" if NUMBER_TYPES[name] == "string" else "%d"
    go_format = PLACEHOLDER.sub(verb, template.replace("%", "%%"))
    return (
        f"// {_camel(name)} formats {module}.{name}.\n"
        f"func {_camel(name)}({args} {NUMBER_TYPES[name]}) string {{\n"
        f"\treturn fmt.Sprintf({json.dumps(go_format)}, {args})\n"
        "}\n"
    )


def _const_block(constants: dict[str, str], comment: str = "") -> list[str]:
    """A Go const block, aligned as gofmt aligns it."""
    width = max(map(len, constants))
    return [
        *([f"// {comment}"] if comment else []),
        "const (",
        *(f"\t{name:<{width}} = {value}" for name, value in constants.items()),
        ")",
        "",
    ]


def _texts() -> dict[str, str]:
    """status_texts' messages, in the order the module defines them."""
    return {
        name: value
        for name, value in vars(status_texts).items()
        if name.isupper() and isinstance(value, str)
    }


def render() -> str:
    constants = {
        "statusPageName": f'"{status_page.PAGE_NAME}"',
        "statusPageBytes": str(status_page.PAGE_BYTES),
        "statusReadTries": str(status_page.READ_TRIES),
    }
    for name in dir(status_page):
        if name.endswith("_OFFSET"):
            constants[_camel(f"status_{name}")] = str(getattr(status_page, name))
    constants["slabHeaderBytes"] = str(slab.HEADER_BYTES)
    constants["slabReadRequestsOffset"] = str(slab.READ_REQUESTS_OFFSET)
    constants["slabReadBytesOffset"] = str(slab.READ_BYTES_OFFSET)
    constants["slabReleaseBytes"] = str(slab.RELEASE_BYTES)
    constants["shownChars"] = str(SHOWN_CHARS)
    texts = {name: text for name, text in _texts().items() if not PLACEHOLDER.search(text)}
    templates = {name: text for name, text in _texts().items() if PLACEHOLDER.search(text)}
    lines = [
        "// Code generated by scripts/go_contract.py from service/ipc/status_page.py, "
        "service/ipc/slab.py, service/status_texts.py and service/text.py; DO NOT EDIT.",
        "",
        "package main",
        "",
        'import "fmt"',
        "",
        *_const_block(constants),
        *_const_block(
            {_camel(name): json.dumps(text) for name, text in texts.items()},
            "Status messages, word for word as service/status_texts.py has them.",
        ),
        _formatter("status_page", "QUEUE_FULL_BY_COUNT", status_page.QUEUE_FULL_BY_COUNT),
        _formatter("status_page", "QUEUE_FULL_BY_BYTES", status_page.QUEUE_FULL_BY_BYTES),
        *(_formatter("status_texts", name, text) for name, text in templates.items()),
        _formatter("text", "SHOWN_MORE", SHOWN_MORE),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def _message(file: Any, path: str) -> Any:
    """The descriptor of the message at path ("Outer.Inner") in a protobuf file."""
    outer, *inner = path.split(".")
    descriptor = file.message_types_by_name[outer]
    for name in inner:
        descriptor = descriptor.nested_types_by_name[name]
    return descriptor


def _messages() -> dict[str, Any]:
    v2, attention = grpc_service_pb2.DESCRIPTOR, attention_pb2.DESCRIPTOR
    messages = {name: _message(v2, path) for name, path in V2_MESSAGES.items()}
    messages.update({name: _message(attention, path) for name, path in ATTENTION_MESSAGES.items()})
    # The health service's, for its Check answered here.
    messages.update({name: _message(health_pb2.DESCRIPTOR, name) for name in HEALTH_MESSAGES})
    entry = [(f.name, f.number) for f in messages["ParametersEntry"].fields]
    for descriptor in messages.values():
        for f in descriptor.fields:
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                same = [(g.name, g.number) for g in f.message_type.fields] == entry
                assert same, f"{f.full_name}'s entries differ from ParametersEntry's"
    return messages


def _field_constants(name: str, descriptor: Any) -> dict[str, str]:
    return {f"field{name}{_camel(f.name, upper=True)}": str(f.number) for f in descriptor.fields}


def _oneofs(descriptor: Any) -> Iterable[str]:
    for oneof in descriptor.oneofs:
        yield f"; oneof {oneof.name}: " + ", ".join(f.name for f in oneof.fields)


def render_proto() -> str:
    lines = [
        "// Code generated by scripts/go_contract.py from the protobuf modules in "
        "service/generated/; DO NOT EDIT.",
        "",
        "package main",
        "",
        "// The field numbers of the messages the gateway reads and writes by hand.",
        "",
    ]
    names: set[str] = set()
    for name, descriptor in _messages().items():
        constants = _field_constants(name, descriptor)
        assert not names & constants.keys(), f"{name}: a Go name is taken twice"
        names |= constants.keys()
        comment = descriptor.full_name + "".join(_oneofs(descriptor))
        if descriptor.GetOptions().map_entry:
            comment += ", as every map<string, InferParameter> of these messages"
        lines += _const_block(constants, comment)
    data_type = attention_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    values = {
        _camel("data_type_" + value.name.removeprefix("DATA_TYPE_")): str(value.number)
        for value in data_type.values
    }
    lines += _const_block(values, f"{data_type.full_name}'s values.")
    return "\n".join(lines).rstrip("\n") + "\n"


Value = str | int | float | bool


def flag_defaults() -> dict[str, tuple[Value, str]]:
    """Each gateway flag with a Python counterpart, in main.go's order: (its default, where
    Python has it)."""
    settings = Settings()
    fields: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Settings)}

    def setting(name: str) -> tuple[Value, str]:
        return fields[name], f"Settings.{name}"

    return {
        # Loopback: the front end always passes --listen (its --host); by hand, this machine.
        "listen": (f"127.0.0.1:{fields['grpc_port']}", "Settings.grpc_port, on 127.0.0.1"),
        "accept-encoding": (
            grpc_options.accepted_encodings(fields["grpc_compression"]),
            "grpc_options.accepted_encodings(Settings.grpc_compression)",
        ),
        # The least a front end's slab is: --shared-memory-bytes 0 and no queue bound.
        "slab-bytes": (server.slab_bytes(settings, 0), "frontend.server.slab_bytes, at least"),
        "max-seq-len": setting("max_seq_len"),
        "client-shared-memory": (
            fields["client_shared_memory"] == "on",
            "Settings.client_shared_memory",
        ),
        "max-batch-size": setting("max_batch_size"),
        # The receive bound of a front end with no model served yet.
        "max-receive-bytes": (
            limits.message_limits([], settings)[0],
            "frontend.limits.message_limits, no model served",
        ),
        # The whole server's bounds (a front end passes its gateway a share of them).
        "max-undelivered-bytes": setting("max_undelivered_bytes"),
        "max-undelivered-bytes-per-connection": setting("max_undelivered_bytes_per_connection"),
        "max-metadata-bytes": setting("max_metadata_bytes"),
        # logging.go's: a gateway started by hand logs as a server started with no flags.
        "log-level": setting("log_level"),
        "log-format": setting("log_format"),
        "max-connection-idle-s": setting("max_connection_idle_s"),
        "max-connection-age-s": setting("max_connection_age_s"),
        "max-concurrent-streams": (
            grpc_options.MAX_CONCURRENT_STREAMS,
            "grpc_options.MAX_CONCURRENT_STREAMS",
        ),
        "max-stream-inflight-requests": setting("max_stream_inflight_requests"),
        "max-stream-pending-bytes": setting("max_stream_pending_bytes"),
        "keepalive-s": (grpc_options.KEEPALIVE_TIME_MS / 1000, "grpc_options.KEEPALIVE_TIME_MS"),
        "keepalive-timeout-s": (
            grpc_options.KEEPALIVE_TIMEOUT_MS / 1000,
            "grpc_options.KEEPALIVE_TIMEOUT_MS",
        ),
        "min-client-ping-interval-s": (
            grpc_options.MIN_CLIENT_PING_INTERVAL_MS / 1000,
            "grpc_options.MIN_CLIENT_PING_INTERVAL_MS",
        ),
        "max-ping-strikes": (grpc_options.MAX_PING_STRIKES, "grpc_options.MAX_PING_STRIKES"),
        "deadline-slack-s": (dataplane.DEADLINE_SLACK_S, "dataplane.DEADLINE_SLACK_S"),
        "shutdown-not-serving-s": setting("shutdown_not_serving_s"),
        "grace-period-s": setting("grace_period_s"),
        "refuse-linger-s": (gateway.REFUSE_LINGER_S, "frontend.gateway.REFUSE_LINGER_S"),
        "write-margin-s": (gateway.WRITE_MARGIN_S, "frontend.gateway.WRITE_MARGIN_S"),
        "heartbeat-s": (gateway.HEARTBEAT_S, "frontend.gateway.HEARTBEAT_S"),
    }


def default_constant(flag: str) -> str:
    """The Go name of a flag's default: defaultMaxSeqLen for --max-seq-len."""
    return "default" + _camel(flag.replace("-", "_"), upper=True)


def _go_value(value: Value) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def render_defaults() -> str:
    specs = {
        default_constant(flag): (_go_value(value), source)
        for flag, (value, source) in flag_defaults().items()
    }
    name_width = max(map(len, specs))
    value_width = max(len(value) for value, _ in specs.values())
    lines = [
        "// Code generated by scripts/go_contract.py from service/settings.py, "
        "service/transport/grpc_options.py, service/dataplane.py and service/frontend/; "
        "DO NOT EDIT.",
        "",
        "package main",
        "",
        "// The flags' defaults, from the Python that defines them: Settings' defaults and the",
        "// constants service/frontend/gateway.py passes. A front end passes every flag; these",
        "// serve a gateway started by hand.",
        "const (",
        *(
            f"\t{name:<{name_width}} = {value:<{value_width}} // {source}"
            for name, (value, source) in specs.items()
        ),
        ")",
    ]
    return "\n".join(lines) + "\n"


def _stale(path: Path, text: str) -> bool:
    return not path.exists() or path.read_text() != text


def generated() -> dict[Path, str]:
    """Every generated Go file, with the text it should hold."""
    return {
        GO_FILE: render(),
        PROTO_GO_FILE: render_proto(),
        DEFAULTS_GO_FILE: render_defaults(),
        WIRE_GO_FILE: go_wire_contract.render(),
        API_GO_FILE: go_api_contract.render(),
        FRONTEND_GO_FILE: go_frontend_contract.render(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a Go file is stale")
    args = parser.parse_args(argv)
    files = generated()
    if args.check:
        stale = [path for path, text in files.items() if _stale(path, text)]
        for path in stale:
            sys.stderr.write(f"{path} is stale: run python -m scripts.go_contract\n")
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
