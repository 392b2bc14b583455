"""Reading a control message's JSON object field by field, each checked for its type: a
malformed message is a ValueError that names the message, the field and what it holds."""

from __future__ import annotations

from typing import Any

SHOWN_CHARS = 40  # of a wrong value, in the error: enough to recognise it


def shown_value(value: object) -> str:
    """A wrong value for an error message: its repr (control characters escaped), cut short."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


def is_integer(value: object) -> bool:
    """JSON's integers (json.loads gives true and false as bools, which are ints too)."""
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """The fields of one JSON object (a message of kind, or a part of one)."""

    def __init__(self, data: object, kind: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{kind} is a JSON object, got {type(data).__name__}")
        self.data: dict[str, Any] = data
        self.kind = kind

    def _wrong(self, key: str, expected: str) -> ValueError:
        if key not in self.data:
            return ValueError(f"{self.kind} message without {key!r} ({expected})")
        value = shown_value(self.data[key])
        return ValueError(f"{self.kind} message: {key!r} should be {expected}, got {value}")

    def integer(self, key: str) -> int:
        value = self.data.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._wrong(key, "an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self.data.get(key) is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(key, "a number")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        return None if self.data.get(key) is None else self.number(key)

    def flag(self, key: str) -> bool:
        value = self.data.get(key)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false")
        return value

    def text(self, key: str) -> str:
        value = self.data.get(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def array(self, key: str) -> list[Any]:
        value = self.data.get(key)
        if not isinstance(value, list):
            raise self._wrong(key, "an array")
        return value

    def integers(self, key: str, length: int | None = None) -> tuple[int, ...]:
        """An array of integers, of length items when given."""
        items = self.data.get(key)
        expected = "an array of integers" if length is None else f"{length} integers"
        if not isinstance(items, list) or (length is not None and len(items) != length):
            raise self._wrong(key, expected)
        if not all(is_integer(item) for item in items):
            raise self._wrong(key, expected)
        return tuple(items)

    def obj(self, key: str) -> dict[str, Any]:
        value = self.data.get(key)
        if not isinstance(value, dict):
            raise self._wrong(key, "an object")
        return value
