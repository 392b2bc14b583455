"""The gateway's Go keeps no private copy of the contract: protobuf field numbers and the
status messages it writes come from the generated Go (scripts/go_contract.py, from the
descriptors Python serves with and from service/status_texts.py), never from literals.
tests/test_status_page.py checks that the generated Go is current."""

from __future__ import annotations

import re
from pathlib import Path

from service import status_texts
from service.ipc import status_page

GATEWAY = Path(__file__).resolve().parent.parent / "service" / "gateway"
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
