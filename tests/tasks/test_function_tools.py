"""Typed Python functions as tools: schemas from signatures and docstrings, argument checks, the registry."""

from __future__ import annotations

import functools
from typing import Literal, Optional

import pytest

from services.tasks.function_tools import (
    ToolDefinitionError,
    check_arguments,
    check_call,
    function_schema,
    is_async,
    tools_by_name,
)


def book(
    city: str,
    nights: int,
    budget: float,
    breakfast: bool,
    guests: list[str],
    prices: dict[str, float],
    room: Literal["single", "double"],
    floors: list[list[int]] | None = None,
    note: Optional[str] = None,  # noqa: UP045 - the typing.Optional spelling is what is tested
    stars: Literal[3, 4, 5] | None = None,
    tags: dict[str, list[bool]] | None = None,
) -> str:
    """Book a hotel room
    for some nights.

    Everything after the first paragraph is not the description.

    Args:
        city: where to stay.
        nights (int): how many nights;
            at least one.
        budget: the most to pay per night, in euros.
        room: the kind of room.
        stars: the hotel's stars, if it matters.

    Returns:
        the booking reference.
    """
    return ""


async def lookup(query: str, limit: int = 10) -> list[str]:
    """Look something up.

    :param query: what to look for,
        in plain words.
    :param int limit: at most this many results.
    :returns: the results.
    """
    return []


EXPECTED_BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a hotel room for some nights.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "where to stay."},
                "nights": {"type": "integer", "description": "how many nights; at least one."},
                "budget": {"type": "number", "description": "the most to pay per night, in euros."},
                "breakfast": {"type": "boolean"},
                "guests": {"type": "array", "items": {"type": "string"}},
                "prices": {"type": "object", "additionalProperties": {"type": "number"}},
                "room": {"type": "string", "enum": ["single", "double"], "description": "the kind of room."},
                "floors": {"type": ["array", "null"], "items": {"type": "array", "items": {"type": "integer"}}},
                "note": {"type": ["string", "null"]},
                "stars": {"type": ["integer", "null"], "enum": [3, 4, 5, None],
                          "description": "the hotel's stars, if it matters."},
                "tags": {"type": ["object", "null"],
                         "additionalProperties": {"type": "array", "items": {"type": "boolean"}}},
            },
            "required": ["city", "nights", "budget", "breakfast", "guests", "prices", "room"],
            "additionalProperties": False,
        },
    },
}

EXPECTED_LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "what to look for, in plain words."},
                "limit": {"type": "integer", "description": "at most this many results."},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


def test_schema_of_every_supported_annotation_with_a_google_docstring():
    assert function_schema(book) == EXPECTED_BOOK


def test_schema_of_an_async_function_with_a_sphinx_docstring():
    assert function_schema(lookup) == EXPECTED_LOOKUP
    assert is_async(lookup) and not is_async(book)
    assert is_async(functools.partial(lookup, limit=3))


def test_no_docstring_gives_an_empty_description():
    def now() -> str:
        return ""

    assert function_schema(now)["function"] == {
        "name": "now", "description": "",
        "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False}}


def _untyped(x):
    return x


def _anything(x: object) -> None:
    return None


def _union(x: int | str) -> None:
    return None


def _bare_list(x: list) -> None:
    return None


def _int_keys(x: dict[int, str]) -> None:
    return None


def _bytes_literal(x: Literal[b"x"]) -> None:
    return None


def _nested_bad(x: list[set[int]]) -> None:
    return None


def _var_args(*xs: int) -> None:
    return None


def _documents_ghost(x: int) -> None:
    """Do it.

    Args:
        x: a number.
        y: not an argument.
    """


def _undefined_hint(x: NoSuchType) -> None:  # noqa: F821
    return None


@pytest.mark.parametrize(("fn", "words"), [
    (_untyped, ["'_untyped'", "'x'", "no type annotation"]),
    (_anything, ["'_anything'", "'x'", "unsupported annotation"]),
    (_union, ["'x'", "only Optional[T] / T | None unions"]),
    (_bare_list, ["'x'", "write list[T] or dict[str, T]"]),
    (_int_keys, ["'x'", "dict keys must be str"]),
    (_bytes_literal, ["'x'", "Literal values must be str, int, float or bool"]),
    (_nested_bad, ["'x' (list item)", "unsupported annotation"]),
    (_var_args, ["'xs'", "*args and **kwargs"]),
    (_documents_ghost, ["'_documents_ghost'", "documents y", "arguments: x"]),
    (_undefined_hint, ["'_undefined_hint'", "cannot be resolved"]),
    (lambda x: x, ["'<lambda>'", "[A-Za-z0-9_-]{1,64}"]),
])
def test_unsupported_definitions_name_function_and_argument(fn, words):
    with pytest.raises(ToolDefinitionError) as info:
        function_schema(fn)
    for word in words:
        assert word in str(info.value)


def test_check_arguments_accepts_a_good_call_and_ints_for_floats():
    schema = function_schema(book)
    good = {"city": "Oslo", "nights": 2, "budget": 120, "breakfast": True, "guests": ["a"],
            "prices": {"mon": 99.5, "tue": 100}, "room": "double", "floors": [[1, 2]], "note": None,
            "stars": 4, "tags": {"quiet": [True]}}
    assert check_arguments(schema, good) == []


def test_check_arguments_names_each_problem():
    schema = function_schema(book)
    bad = {"city": 7, "nights": 2.0, "budget": True, "breakfast": "yes", "guests": ["a", 3],
           "prices": {"mon": "cheap"}, "room": "suite", "floors": [[1, "2"]], "stars": 2,
           "tags": {"x": [1]}, "pets": 1}
    assert check_arguments(schema, bad) == [
        "tool 'book': argument 'city': expected a string, got the integer 7",
        "tool 'book': argument 'nights': expected an integer, got the number 2.0",
        "tool 'book': argument 'budget': expected a number, got the boolean True",
        "tool 'book': argument 'breakfast': expected a boolean, got the string 'yes'",
        "tool 'book': argument 'guests'[1]: expected a string, got the integer 3",
        "tool 'book': argument 'prices'['mon']: expected a number, got the string 'cheap'",
        "tool 'book': argument 'room': must be one of 'single', 'double', got the string 'suite'",
        "tool 'book': argument 'floors'[0][1]: expected an integer, got the string '2'",
        "tool 'book': argument 'stars': must be one of 3, 4, 5, None, got the integer 2",
        "tool 'book': argument 'tags'['x'][0]: expected a boolean, got the integer 1",
        "tool 'book': unexpected argument 'pets'; it takes: city, nights, budget, breakfast, guests, prices, "
        "room, floors, note, stars, tags",
    ]


def test_check_arguments_missing_required_and_not_an_object():
    schema = function_schema(lookup)
    assert check_arguments(schema, {}) == ["tool 'lookup': missing required argument 'query' (a string)"]
    assert check_arguments(schema, {"query": "x", "limit": [1]}) == [
        "tool 'lookup': argument 'limit': expected an integer, got the list [1]"]
    assert check_arguments(schema, [1]) == [  # type: ignore[arg-type]
        "tool 'lookup': arguments must be a JSON object, got the list [1]"]
    assert check_arguments(function_schema(book), {"city": "x"})[0] == \
        "tool 'book': missing required argument 'nights' (an integer)"


def test_tools_by_name_and_check_call():
    tools = tools_by_name([book, lookup])
    assert list(tools) == ["book", "lookup"]
    assert tools["lookup"].is_async and not tools["book"].is_async
    assert tools["lookup"].schema == EXPECTED_LOOKUP and tools["lookup"].fn is lookup
    assert check_call(tools, "lookup", {"query": "x"}) == []
    assert check_call(tools, "search", {}) == ["unknown tool 'search'; the tools are: book, lookup"]
    with pytest.raises(ToolDefinitionError, match="two tools are named 'lookup'"):
        tools_by_name([lookup, book, lookup])
