"""Client strings made safe to echo: bounded length, control characters escaped.

A model name or request id goes into error messages (gRPC trailing metadata, limited to a
few KiB in total, so a long one turned NOT_FOUND into RESOURCE_EXHAUSTED) and into log lines
(where a newline in it forged a line). Everything a client sends passes through shown()
before it reaches either.
"""

from __future__ import annotations

SHOWN_CHARS = 64  # enough for any real name or id; the rest is counted, not echoed
SHOWN_MORE = "... ({more} more characters)"  # after a text cut short


def _escape(char: str) -> str:
    if char.isprintable() and char not in "\\'":
        return char
    return char.encode("unicode_escape").decode("ascii") if char != "'" else "\\'"


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """text quoted, with non-printable characters escaped and cut after limit characters."""
    head = "".join(_escape(char) for char in text[:limit])
    return f"'{head}'" + _rest_counted(text, limit)


def _rest_counted(text: str, limit: int) -> str:
    """What follows a text cut after limit characters: how many were left out, if any."""
    more = len(text) - limit
    return SHOWN_MORE.format(more=more) if more > 0 else ""


SHOWN_NAMES = 16  # of a list of names; the rest are counted


def shown_names(names: list[str]) -> str:
    """A list of names for a message: each shown(), the first SHOWN_NAMES of them."""
    listed = ", ".join(shown(name) for name in names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return f"[{listed}" + (f", ... ({more} more)]" if more > 0 else "]")


def cut(text: str, limit: int) -> str:
    """text, cut after limit characters (a text of the server's own, not quoted)."""
    return text[:limit] + _rest_counted(text, limit)


def model_reference(name: str, version: int | str) -> str:
    """How a message names a served version: model 'name' version N."""
    return f"model {shown(name)} version {version}"


SHOWN_DIMS = 6


def shown_shape(shape: list[int]) -> str:
    """A shape for a message: the first few dimensions of an absurdly long one."""
    if len(shape) <= SHOWN_DIMS:
        return str(shape)
    return f"[{', '.join(map(str, shape[:SHOWN_DIMS]))}, ... ({len(shape)} dimensions)]"
