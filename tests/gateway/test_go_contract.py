"""The gateway's Go keeps no private copy of the contract: protobuf field numbers, the
status messages it writes, its flags' defaults, the control messages' words and layouts,
status codes and metric labels come from the generated Go (scripts/go_contract.py and
scripts/go_wire_contract.py, from the descriptors Python serves with, service/status_texts.py,
service/settings.py, the constants the front end passes, service/ipc and metrics.py), never
from literals; and the generated Go is current."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import grpc

from scripts import go_api_contract, go_contract, go_frontend_contract, go_wire_contract
from service import dataplane, status_texts
from service.app import children
from service.frontend import (
    attention_servicer,
    caller,
    gateway,
    limits,
    server,
    shm_tensors,
    v2_codec,
)
from service.ipc import status_page
from service.ipc.keys import Key, MessageType, ModelKey, words
from service.observability import metrics
from service.settings import Settings
from service.transport import grpc_options

GATEWAY = Path(__file__).resolve().parents[2] / "service" / "gateway"
# The protowire helpers, and which argument (from 0) is the field number.
FIELD_ARGUMENT = {
    "appendTag": 1,
    "appendBytesField": 1,
    "appendStringField": 1,
    "appendNonEmpty": 1,
    "appendVarintField": 1,
    "appendPackedInt64s": 1,
    "appendRefParameters": 1,
    "nested": 1,
    "tensor": 1,
    "bytesField": 0,
}
CALL = re.compile(r"\b(" + "|".join(FIELD_ARGUMENT) + r")\(")
CASE = re.compile(r"^(\t*)case (.*):")
SWITCH = re.compile(r"^(\t*)switch (.*) \{")
NUM_COMPARED = re.compile(r"\.num\s*[!=]=\s*\d")
NUMBER_KEYED_MAP = re.compile(r"map\[int\]\w+\{[^}]*?[{,\s]\d+\s*:", re.DOTALL)
# A field number's constant belongs in proto_gen.go, generated.
FIELD_CONSTANT = re.compile(r"^[ \t]*(?:const )?field[A-Z]\w*( \w+)? = \d", re.MULTILINE)
# flag.XVar(pointer, name, default, usage) and flag.X(name, default, usage).
FLAG_CALL = re.compile(r"\bflag\.(\w+?)(Var)?\(")
FLAG_DEFAULT_LITERAL = re.compile(r"^[-+(]*\.?\d|^(true|false)$")
GO_CONSTANT = re.compile(r"^\t(\w+)\s+= (.+?)(?:\s+//.*)?$", re.MULTILINE)
# Flags whose numeric or boolean default has no Python counterpart, and why. None today:
# every such default is generated into defaults_gen.go (scripts/go_contract.py).
GO_ONLY_DEFAULTS: dict[str, str] = {}


def _without_comments(source: str) -> str:
    """source with its // comments blanked (line numbers kept)."""
    out, i, quote = [], 0, ""
    while i < len(source):
        char = source[i]
        if quote:
            if char == "\\" and quote != "`":
                out.append(source[i : i + 2])
                i += 2
                continue
            quote = "" if char == quote else quote
        elif char in "\"'`":
            quote = char
        elif source.startswith("//", i):
            end = source.find("\n", i)
            end = len(source) if end < 0 else end
            out.append(" " * (end - i))
            i = end
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _arguments(code: str, start: int) -> list[str]:
    """The arguments of the call whose "(" is just before start, split at top-level commas."""
    arguments, depth, quote, begun = [], 0, "", start
    i = start
    while i < len(code):
        char = code[i]
        if quote:
            if char == "\\" and quote != "`":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "\"'`":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}" and depth:
            depth -= 1
        elif char in ",)" and not depth:
            arguments.append(code[begun:i].strip())
            if char == ")":
                return arguments
            begun = i + 1
        i += 1
    raise ValueError("unterminated call")


def _switch_of(lines: list[str], number: int, indent: str) -> re.Match[str] | None:
    """The switch (or select) a case line belongs to: gofmt puts both at one indentation."""
    for above in reversed(lines[:number]):
        rest = above.removeprefix(indent)
        if rest != above and rest.strip() and not rest.startswith(("\t", "case ", "default:")):
            return SWITCH.match(above)
    return None


def _line(code: str, at: int) -> int:
    return code.count("\n", 0, at) + 1


def _literal_cases(lines: list[str]) -> list[tuple[int, str]]:
    """Cases of a switch on a field number with a number among their labels."""
    found = []
    for number, line in enumerate(lines):
        case = CASE.match(line)
        switch = case and _switch_of(lines, number, case[1])
        labels = case[2].split(",") if case else []
        if switch and switch[2].endswith(".num") and any(lb.strip()[:1].isdigit() for lb in labels):
            found.append((number + 1, line.strip()))
    return found


def literal_field_numbers(source: str) -> list[str]:
    """Where source (gofmt'd Go) writes a field number as a literal, by line."""
    code = _without_comments(source)
    found = _literal_cases(code.splitlines())
    found += [(_line(code, m.start()), m[0]) for m in NUM_COMPARED.finditer(code)]
    for call in CALL.finditer(code):
        arguments = _arguments(code, call.end())
        argument = arguments[FIELD_ARGUMENT[call[1]]] if len(arguments) > 1 else ""
        if argument[:1].isdigit():
            found.append((_line(code, call.start()), f"{call[1]}(..., {argument}, ...)"))
    found += [(_line(code, m.start()), m[0].strip()) for m in FIELD_CONSTANT.finditer(code)]
    found += [
        (_line(code, m.start()), "a map keyed by numbers") for m in NUMBER_KEYED_MAP.finditer(code)
    ]
    return [f"{line}: {what}" for line, what in sorted(found)]


def _hand_written_go() -> list[Path]:
    return [
        path
        for path in sorted(GATEWAY.glob("*.go"))
        if not path.name.endswith("_test.go")
        and not path.read_text().startswith("// Code generated ")
    ]


def test_no_hand_written_go_has_a_literal_field_number() -> None:
    found = {
        path.name: where
        for path in _hand_written_go()
        if (where := literal_field_numbers(path.read_text()))
    }
    assert not found, f"use the field<Message><Field> constants of proto_gen.go: {found}"


def test_no_hand_written_go_spells_out_a_status_message() -> None:
    """Each message of the catalogue (a string literal starting with its words, up to any
    number) is in the generated Go alone."""
    messages = [status_page.QUEUE_FULL_BY_COUNT, status_page.QUEUE_FULL_BY_BYTES]
    messages += [value for name, value in vars(status_texts).items() if name.isupper()]
    found = [
        f"{path.name}: {words!r}"
        for path in _hand_written_go()
        for message in messages
        if '"' + (words := message.split("{")[0][:40]) in _without_comments(path.read_text())
    ]
    assert not found, f"use the constants and formatters of contract_gen.go: {found}"


def test_the_check_finds_literal_field_numbers() -> None:
    """The guard above is only as good as this: it finds each form a literal could take."""
    source = "\n".join(
        [
            "func f(msg []byte) {",
            "\tswitch f.num {",
            "\tcase fieldA:",
            "\t\tswitch f.value {",
            "\t\tcase 1:",  # not a field number: the nearest switch is on a value
            "\t\t}",
            "\t// case 4:",
            "\tcase fieldB, 3:",
            "\t}",
            "\tif g.num == 2 {",
            "\t}",
            '\tb = appendNonEmpty(make([]byte, 5, 5+len(m)), 1, "a,b(") // appendTag(b, 1, 2)',
            "\tb = appendTag(b, fieldC, wireBytes)",
            "\tm.bytesField(6, data) // it's",
            "\tvar wires = map[int]int{fieldD: wireVarint,",
            "\t\t4: wireFixed64}",
            "}",
            "const fieldTensorShape = 1",
        ]
    )
    found = literal_field_numbers(source)
    assert [entry.split(":")[0] for entry in found] == ["8", "10", "12", "14", "15", "18"], found


def flag_definitions(source: str) -> list[tuple[int, str, str]]:
    """(line, flag name, default as written) for each flag source (gofmt'd Go) defines."""
    code = _without_comments(source)
    found = []
    for call in FLAG_CALL.finditer(code):
        if call[1] in ("Parse", "Args", "Arg", "NArg", "NFlag", "Set", "Lookup", "Visit"):
            continue
        arguments = _arguments(code, call.end())[1 if call[2] else 0 :]
        if len(arguments) == 3 and arguments[0].startswith('"'):
            found.append((_line(code, call.start()), json.loads(arguments[0]), arguments[1]))
    return found


def literal_flag_defaults(source: str) -> list[str]:
    """Where source defines a flag with a numeric or boolean literal for its default."""
    return [
        f"{line}: --{name} {default}"
        for line, name, default in flag_definitions(source)
        if FLAG_DEFAULT_LITERAL.match(default) and name not in GO_ONLY_DEFAULTS
    ]


def _main_flags() -> dict[str, str]:
    """Every hand-written Go file's flags (main.go's, logging.go's) and their defaults."""
    return {
        name: default
        for path in _hand_written_go()
        for _, name, default in flag_definitions(path.read_text())
    }


def _read(name: str) -> str:
    return (GATEWAY / name).read_text()


def _go_value(literal: str) -> object:
    """A generated constant's value, as Python reads it."""
    if literal in ("true", "false"):
        return literal == "true"
    return json.loads(literal)


def test_no_hand_written_go_has_a_literal_flag_default() -> None:
    found = {
        path.name: where
        for path in _hand_written_go()
        if (where := literal_flag_defaults(path.read_text()))
    }
    assert not found, (
        "take the default from Python: add the flag to scripts/go_contract.py's "
        f"flag_defaults and use its default<Flag> constant of defaults_gen.go: {found}"
    )
    defined = {
        name for path in _hand_written_go() for _, name, _ in flag_definitions(path.read_text())
    }
    assert GO_ONLY_DEFAULTS.keys() <= defined, "GO_ONLY_DEFAULTS names a flag no longer defined"


def test_the_check_finds_literal_flag_defaults() -> None:
    source = "\n".join(
        [
            "func parse() {",
            '\tflag.IntVar(&o.a, "a", 64<<20, "bytes, as 1<<20")',
            '\tflag.Float64Var(&b, "b", defaultB, "") // flag.IntVar(&c, "c", 1, "")',
            '\tflag.BoolVar(&o.d, "d", false, "")',
            '\tx := flag.Int("e", -1, "a, b")',
            '\tflag.Float64Var(&f, "f", .5, "")',
            '\tflag.StringVar(&g, "g", "1", "")',
            "\tflag.Parse()",
            "}",
        ]
    )
    assert [name for _, name, _ in flag_definitions(source)] == list("abdefg")
    found = literal_flag_defaults(source)
    assert [entry.split(":")[0] for entry in found] == ["2", "4", "5", "6"], found


def test_each_flag_with_a_python_default_takes_its_generated_constant() -> None:
    flags = _main_flags()
    wrong = {
        flag: flags.get(flag)
        for flag in go_contract.flag_defaults()
        if flags.get(flag) != go_contract.default_constant(flag)
    }
    assert not wrong, f"the gateway's flags that do not take their default<Flag> constant: {wrong}"


def test_the_generated_defaults_are_pythons() -> None:
    """Read back from defaults_gen.go through main.go's flags: each flag named as a Settings
    field defaults to that field's default; the others to the constants the front end
    passes them (service/frontend/gateway.py)."""
    constants = {m[1]: _go_value(m[2]) for m in GO_CONSTANT.finditer(_read("defaults_gen.go"))}
    flags = {name: constants.get(default) for name, default in _main_flags().items()}
    settings = {f.name.replace("_", "-"): f.default for f in dataclasses.fields(Settings)}
    # Settings' None (the TLS files: none) is Go's empty string, nothing to generate.
    unset = {name for name in flags.keys() & settings.keys() if settings[name] is None}
    assert {name: _main_flags()[name] for name in unset} == dict.fromkeys(unset, '""')
    expected = {name: settings[name] for name in flags.keys() & settings.keys() - unset}
    assert len(expected) >= 10, sorted(expected)
    expected |= {
        "client-shared-memory": settings["client-shared-memory"] == "on",
        "listen": f"127.0.0.1:{settings['grpc-port']}",
        "accept-encoding": grpc_options.accepted_encodings(settings["grpc-compression"]),
        "max-concurrent-streams": grpc_options.MAX_CONCURRENT_STREAMS,
        "keepalive-s": grpc_options.KEEPALIVE_TIME_MS / 1000,
        "keepalive-timeout-s": grpc_options.KEEPALIVE_TIMEOUT_MS / 1000,
        "min-client-ping-interval-s": grpc_options.MIN_CLIENT_PING_INTERVAL_MS / 1000,
        "max-ping-strikes": grpc_options.MAX_PING_STRIKES,
        "deadline-slack-s": dataplane.DEADLINE_SLACK_S,
        # A front end's least slab (no queue bound), and its receive bound with no model.
        "slab-bytes": server.slab_bytes(Settings(), 0),
        "max-receive-bytes": limits.message_limits([], Settings())[0],
        # The Python front end's own drain, which the gateway's follows.
        "refuse-linger-s": server.REFUSE_LINGER_S,
        "write-margin-s": server.WRITE_MARGIN_S,
        # As every child beats for the supervisor's watchdog.
        "heartbeat-s": children.HEARTBEAT_S,
    }
    assert expected.keys() == go_contract.flag_defaults().keys()
    found = {name: flags.get(name) for name in expected}
    assert found == expected


def test_every_generated_go_file_is_current() -> None:
    """An edit to a generated file alone (or to the Python it comes from) fails here."""
    marked = {
        path
        for path in GATEWAY.glob("*.go")
        if path.read_text().startswith("// Code generated by scripts/go_")
    }
    files = go_contract.generated()
    assert marked == files.keys(), "a generated Go file that go_contract does not write"
    stale = [path.name for path, text in files.items() if path.read_text() != text]
    assert not stale, f"stale: run python -m scripts.go_contract ({stale})"


def wire_words() -> dict[str, set[str]]:
    """The words hand-written Go takes from wire_gen.go, by what they are."""
    return {
        "a control message's type: message<Type>": set(words(MessageType).values()),
        "a control message's key: key<Name>": set(words(Key).values()),
        "a served version's key: modelInfo": set(words(ModelKey).values()),
        "a worker's error kind: kind<Kind>": set(go_wire_contract.error_kinds().values()),
        "a status code's name: codeNames": {code.name for code in grpc.StatusCode},
        "a metric's label name: label<Name>": set(go_wire_contract.label_names().values()),
        "an api label's value: api<Name>": set(words(metrics.Api).values()),
        "a gRPC method's path: <method>Path": set(go_api_contract.method_paths().values()),
        "a tensor's name: inputName, outputName, weightsName": {
            v2_codec.INPUT_NAME,
            *v2_codec.OUTPUT_NAMES,
        },
        "a dtype's name: dtypes, weightsDatatype, weightsNumpy, attentionDatatype": {
            name
            for numpy_name, (v2_name, code, _) in go_api_contract.served_dtypes().items()
            for name in (numpy_name, v2_name, code)
        },
        "a tensor parameter's name: param<Name>, tolerated<Input|Output>Params": {
            *shm_tensors.PARAMETERS,
            *v2_codec.TOLERATED_REQUEST_PARAMETERS,
            *v2_codec.TOLERATED_INPUT_PARAMETERS,
            *v2_codec.TOLERATED_OUTPUT_PARAMETERS,
        },
        "an AttendRequest region field's name: regionFields": set(attention_servicer.REGION_FIELDS),
        "a key of the metrics' spec: metricsSpec": _spec_keys(),
        "a key of the restrictions: restrictionsJSON": _restrictions_keys(),
        "a metrics file's kind: <kind>File": set(go_frontend_contract.file_prefixes().values()),
        "a scope label's value: scope<Name>": set(words(metrics.Scope).values()),
    }


def _spec_keys() -> set[str]:
    """The keys of gateway.metrics_spec()'s JSON, and of each series' object in it."""
    spec = gateway.metrics_spec()
    return set(spec).union(*spec.values())


def _restrictions_keys() -> set[str]:
    """The keys of Restrictions.for_gateway's JSON and of a key's object (not its maps')."""
    described = go_frontend_contract.restrictions()
    return set(described) | set(described["keys"][go_frontend_contract.GROUP])


def wire_phrases() -> dict[str, set[str]]:
    """Words hand-written Go may not spell even inside a longer string, in any case."""
    return {
        "a gRPC service's name: the <method>Path constants": set(go_api_contract.service_names()),
        "a header naming the caller: peerHeader, subjectHeader": {
            caller.PEER_HEADER,
            caller.SUBJECT_HEADER,
        },
        "an environment variable the front end sets: <what>Variable": set(
            go_frontend_contract.variables().values()
        ),
    }


GO_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"|`([^`]*)`')
QUOTED = re.compile(r'"([^"\\]*)"')
IMPORTS = re.compile(r'^import (\([^)]*\)|"[^"]*")', re.MULTILINE)


def literal_wire_words(source: str) -> list[str]:
    """Where source (gofmt'd Go) spells out a wire word: as a string, or quoted inside a raw
    string (a struct tag, a JSON snippet). Import paths and flag names are not words."""
    code = _without_comments(source)
    code = IMPORTS.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), code)
    flag_names = {(line, name) for line, name, _ in flag_definitions(source)}
    vocabulary, phrases = wire_words(), wire_phrases()
    found = []
    for m in GO_STRING.finditer(code):
        line = _line(code, m.start())
        candidates = [m[1]] if m[2] is None else [m[2], *QUOTED.findall(m[2])]
        for word in candidates:
            if (line, word) in flag_names:
                continue
            found += [f"{line}: {word!r}, {what}" for what, ws in vocabulary.items() if word in ws]
            found += [
                f"{line}: {word!r}, {what}"
                for what, ps in phrases.items()
                if any(phrase.lower() in word.lower() for phrase in ps)
            ]
    return found


def test_no_hand_written_go_spells_out_a_wire_word() -> None:
    found = {
        path.name: where
        for path in _hand_written_go()
        if (where := literal_wire_words(path.read_text()))
    }
    assert not found, f"use the constants and types of wire_gen.go and api_gen.go: {found}"


def test_the_check_finds_literal_wire_words() -> None:
    source = "\n".join(
        [
            "package main",
            "",
            'import (\n\t"sync"\n)',  # an import path, not a message type
            "type m struct {",
            '\tT string `json:"t"`',
            "}",
            "func f() {",
            '\tflag.StringVar(&o.name, "name", "gateway", "") // "name" a flag: fine',
            '\tsend(map[string]any{keyType: "synced", "id": 1})',
            '\tbody := []byte(`{"t":"cancel"}`)',
            '\tif api == "v2_stream" || kind == "QueueFull" || name == "RESOURCE_EXHAUSTED" {',
            '\t\tlabels := map[string]string{"le": "+Inf"} // "model"',
            "\t}",
            "}",
        ]
    )
    found = literal_wire_words(source)
    lines = [int(entry.split(":")[0]) for entry in found]
    assert lines == [7, 11, 11, 12, 12, 13, 13, 13, 14], found


def test_the_check_finds_literal_api_words() -> None:
    source = "\n".join(
        [
            "package main",
            'const attendPath = "/attention.v1.AttentionService/Attend"',
            'var paths = []string{"/inference.grpcinferenceservice/" + name} // any case',
            'func f(name string) bool { return name == "attention_weights" || name == "output" }',
            'func g() string { return "output \'" + "FP32" + "float16" + "<f4" }',
            'var tolerated = map[string]bool{"binary_data_size": true, "shared_memory_region": true}',
            'var regions = map[int]string{1: "output_region"}',
            'var fine = []string{"embedding", "output \'", "an output_region of"}',
        ]
    )
    found = literal_wire_words(source)
    lines = [int(entry.split(":")[0]) for entry in found]
    assert lines == [2, 2, 3, 4, 4, 5, 5, 5, 6, 6, 7], found


def test_the_check_finds_literal_front_end_words() -> None:
    source = "\n".join(
        [
            "package main",
            'const peerHeader = "X-Attention-Gateway-Peer"',
            'func f() error { return fmt.Errorf("ATTENTION_GATEWAY_METRICS: %w", err) }',
            "type spec struct {",
            '\tRefusals metricSpec `json:"undelivered_refusals"`',
            '\tHelp     string     `json:"help"`',
            "}",
            'var files = []string{"counter", "gauge_livesum"}',
            'func g() { m.refused("server"); h.Set("x-attention-gateway-subject", s) }',
            'var fine = []string{"Connection", "inference", "ATTENTION_GATEWAY_CPU_PROFILE"}',
        ]
    )
    found = literal_wire_words(source)
    lines = [int(entry.split(":")[0]) for entry in found]
    assert lines == [2, 3, 5, 6, 8, 8, 9, 9], found


GO_FUNC = re.compile(r"^func (?:\([^)]*\) )?(\w+)\(([^)]*)\)", re.MULTILINE)
# A code constant defined by hand, a code compared with, set to or keyed by a number, and a
# status trailer written as a number.
CODE_CONSTANT = re.compile(r"^[ \t]*(?:const )?code[A-Z]\w*( \w+)? = \d", re.MULTILINE)
CODE_NUMBER = re.compile(r"\bcode\s*(?:[!=]=|:=|=|:)\s*\d")
STATUS_TRAILER = re.compile(r'"Grpc-Status",\s*"\d')
# Reading or writing a little-endian (IPC) field, or a packed message's kind, at a number
# rather than at a generated offset.
PACKED_AT_NUMBER = re.compile(r"LittleEndian\.\w+\(\s*\w+\[\d|\[\d+\]\s*[!=]?=\s*\w+Kind\b")


def _code_parameters(sources: list[str]) -> dict[str, int]:
    """The functions of sources that take a status code, and its argument's position."""
    taking = {}
    for source in sources:
        for m in GO_FUNC.finditer(_without_comments(source)):
            names = [parameter.split()[0] for parameter in m[2].split(",") if parameter.strip()]
            if "code" in names:
                taking[m[1]] = names.index("code")
    return taking


def literal_codes_and_offsets(source: str, code_parameters: dict[str, int]) -> list[str]:
    """Where source writes a status code or a packed field's offset as a number."""
    code = _without_comments(source)
    found = [
        (_line(code, m.start()), m[0].strip())
        for pattern in (CODE_CONSTANT, CODE_NUMBER, STATUS_TRAILER, PACKED_AT_NUMBER)
        for m in pattern.finditer(code)
    ]
    for name, at in code_parameters.items():
        for call in re.finditer(rf"\b{name}\(", code):
            arguments = _arguments(code, call.end())
            if len(arguments) > at and arguments[at][:1].isdigit():
                found.append((_line(code, call.start()), f"{name}(..., {arguments[at]}, ...)"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_no_hand_written_go_has_a_literal_status_code_or_packed_offset() -> None:
    sources = {path.name: path.read_text() for path in _hand_written_go()}
    taking = _code_parameters(list(sources.values()))
    assert {"writeStatus", "failed", "finished"} <= taking.keys(), taking
    found = {
        name: where
        for name, source in sources.items()
        if (where := literal_codes_and_offsets(source, taking))
    }
    assert not found, f"use the code<Name> constants and <message>At<Field> offsets: {found}"


def test_the_check_finds_literal_status_codes_and_offsets() -> None:
    source = "\n".join(
        [
            "const codeQuiet = 99",
            "func failed(code int, message string) outcome { return outcome{code: code} }",
            "func f(body []byte) {",
            "\tif code == 0 || a.code != codeOK {",
            '\t\treturn failed(13, grpcMessage(failed(codeInternal, "x")))',
            "\t}",
            '\th.Set("Grpc-Status", "0")',
            "\tid := binary.LittleEndian.Uint64(body[1:]) + uint64(body[0] == doneKind)",
            "\tbinary.BigEndian.PutUint32(prefix[1:5], n) // gRPC's framing, not IPC",
            "\treturn outcome{code: 4}",
            "}",
        ]
    )
    found = literal_codes_and_offsets(source, _code_parameters([source]))
    assert [int(entry.split(":")[0]) for entry in found] == [1, 4, 5, 7, 8, 8, 10], found
