"""The shapes every tool-call parser returns (:class:`ToolCall`, :class:`Parsed`), the parser protocol, and the
JSON scanning they share; the parsers themselves and their registry are :mod:`services.tasks.toolcalls`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: how many characters of the offending text an error message quotes
EXCERPT_CHARS = 60


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: ``id`` is ``call_<index>`` in message order; ``arguments`` is a JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Parsed:
    """An assistant message split into its content, its well-formed calls and its malformed ones.

    ``errors`` are sentences meant for the model's next observation ("tool call at char 12: invalid
    JSON (...): '...'"); a message may have calls and errors at once.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class UnknownParserError(KeyError):
    """A parser name that is not in :data:`PARSERS`."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0])


class ToolCallParser(Protocol):
    """What every family provides: its name, its stop strings, a parser and a cut-call check."""

    name: str
    #: stop strings that end a turn right after a complete call (beyond the model's EOS)
    stop: tuple[str, ...]

    def parse(self, text: str, tools: Sequence[str] | None = None) -> Parsed:
        """Split ``text`` into content, calls and errors; never raises on model output."""
        ...

    def incomplete(self, text: str) -> bool:
        """True when ``text`` ends inside a call (e.g. cut by the token limit)."""
        ...


# ---------------------------------------------------------------------------------------------------------
# shared pieces


# a whole string literal (skipped), an opening bracket, a closing bracket, or a quote that never closes
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|([{\[])|([}\]])|(")', re.DOTALL)
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")


def excerpt(text: str, start: int = 0) -> str:
    """A short quoted piece of ``text`` from ``start``, for error messages."""
    piece = text[start:start + EXCERPT_CHARS]
    return repr(piece + ("..." if len(text) - start > EXCERPT_CHARS else ""))


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that opens at ``text[start]``; None when it never closes.

    Counts brackets outside string literals (bracket kinds are not matched: the decoder reports a
    mismatch). Linear in the length of the span: see the module docstring. Only malformed or cut calls
    need it; a well-formed one is read by :func:`read_json` in one C-speed pass.
    """
    depth = 0
    for token in _JSON_TOKEN.finditer(text, start):
        kind = token.lastindex
        if kind is None:
            continue  # a string literal
        if kind == 3:
            return None  # a string that never closes
        depth += 1 if kind == 1 else -1
        if depth == 0:
            return token.end()
    return None


def read_json(text: str, start: int) -> tuple[object, int] | str | None:
    """The JSON value at ``text[start]`` (an object or array) as ``(value, end)``; else why it is malformed
    (``"<decoder message> at char N"``), or None when it never closes (the message was cut inside it)."""
    try:
        return _DECODER.raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError) as exc:
        if json_end(text, start) is None:
            return None
        if isinstance(exc, RecursionError):
            return "nested too deeply to decode"
        return f"{exc.msg} at char {exc.pos}"


def skip_space(text: str, pos: int) -> int:
    """The first non-whitespace index at or after ``pos``."""
    match = _WHITESPACE.match(text, pos)
    return match.end() if match is not None else pos


class _Collector:
    """Builds a :class:`Parsed`: numbers calls, applies the ``tools`` filter, words the errors."""

    def __init__(self, tools: Sequence[str] | None) -> None:
        self.tools = None if tools is None else tuple(tools)
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []

    def error(self, at: int, problem: str) -> None:
        self.errors.append(f"tool call at char {at}: {problem}")

    def add(self, at: int, name: str, arguments: dict[str, Any]) -> None:
        if self.tools is not None and name not in self.tools:
            known = ", ".join(self.tools) or "(none)"
            self.error(at, f"unknown tool {name!r}; the tools are: {known}")
            return
        self.calls.append(ToolCall(id=f"call_{len(self.calls)}", name=name, arguments=arguments))

    def add_object(self, at: int, obj: object, argument_keys: tuple[str, ...]) -> None:
        """A decoded ``{"name": ..., "<arguments>": {...}}`` as a call, or an error saying what is wrong."""
        if not isinstance(obj, dict):
            self.error(at, f"expected a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}: "
                           f"{excerpt(json.dumps(obj))}")
            return
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            found = "no \"name\"" if name is None else f"\"name\" is {excerpt(json.dumps(name))}"
            self.error(at, f"{found}; a call needs a non-empty string \"name\": {excerpt(json.dumps(obj))}")
            return
        key = next((k for k in argument_keys if k in obj), None)
        arguments = self.arguments(at, name, {} if key is None else obj[key], key or argument_keys[0])
        if arguments is not None:
            self.add(at, name.strip(), arguments)

    def arguments(self, at: int, name: str, value: object, key: str) -> dict[str, Any] | None:
        """``value`` as an arguments object (a JSON string holding an object is accepted), else an error."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                self.error(at, f"\"{key}\" of {name!r} must be a JSON object, got the string {excerpt(value)}")
                return None
        if not isinstance(value, dict):
            self.error(at, f"\"{key}\" of {name!r} must be a JSON object, got {type(value).__name__}: "
                           f"{excerpt(json.dumps(value))}")
            return None
        return value

    def decode(self, text: str, start: int, end: int) -> tuple[bool, object]:
        """``json.loads`` of ``text[start:end]``; (False, None) with an error recorded when it is not JSON."""
        try:
            return True, json.loads(text[start:end])
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = (f"{exc.msg} at char {start + exc.pos}" if isinstance(exc, json.JSONDecodeError)
                      else "nested too deeply to decode")
            self.error(start, f"invalid JSON ({reason}): {excerpt(text[start:end])}")
            return False, None

    def read(self, text: str, start: int, cut: str) -> tuple[bool, object, int | None]:
        """The JSON value at ``start``: ``(True, value, end)``; ``(False, None, end)`` with an error recorded
        when it is malformed (``end``: where its brackets close, to go on from), ``(False, None, None)``
        with the error ``cut`` recorded when it never closes."""
        found = read_json(text, start)
        if found is None:
            self.error(start, f"{cut}: {excerpt(text, start)}")
            return False, None, None
        if isinstance(found, str):
            end = json_end(text, start)
            self.error(start, f"invalid JSON ({found}): {excerpt(text[start:end])}")
            return False, None, end
        value, end = found
        return True, value, end

    def result(self, content: str) -> Parsed:
        return Parsed(content=content.strip(), calls=self.calls, errors=self.errors)
