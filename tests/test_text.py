"""Client strings and the server's own texts as messages show them: bounded, escaped."""

from __future__ import annotations

from service.text import SHOWN_CHARS, SHOWN_NAMES, cut, shown, shown_names


def test_a_long_name_is_cut_and_counted() -> None:
    assert shown("a" * (SHOWN_CHARS + 6)) == f"'{'a' * SHOWN_CHARS}'... (6 more characters)"
    assert shown("it's\n") == "'it\\'s\\n'"


def test_a_list_of_names_is_bounded_in_length_and_count() -> None:
    assert shown_names(["causal", "mha"]) == "['causal', 'mha']"
    names = [f"m{i:02}" + "x" * 100 for i in range(SHOWN_NAMES + 4)]
    listed = shown_names(names)
    assert listed.endswith(", ... (4 more)]")
    assert listed.count("(39 more characters)") == SHOWN_NAMES
    assert "m16" not in listed
    assert shown_names([]) == "[]"


def test_a_text_of_the_servers_own_is_cut_unquoted() -> None:
    assert cut("abc", 3) == "abc"
    assert cut("abcdef", 3) == "abc... (3 more characters)"
