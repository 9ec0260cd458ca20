"""Typed Python functions as tools: their OpenAI function-tool schema, and checking a call against it.

A tool for native tool calling is a plain (sync or async) Python function with type hints and a
docstring. The chat template shows the model the schema :func:`function_schema` derives, and a call
the model writes (parsed by :mod:`services.tasks.toolcalls`) is checked with :func:`check_arguments`
before it runs, so a wrong call becomes an error observation the model can learn from instead of a
``TypeError`` deep inside the tool::

    def search(query: str, limit: int = 5, kind: Literal["web", "news"] = "web") -> str:
        \"\"\"Search the index.

        Args:
            query: what to look for.
            limit: at most this many hits.
        \"\"\"

    function_schema(search) == {"type": "function", "function": {
        "name": "search", "description": "Search the index.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for."},
            "limit": {"type": "integer", "description": "at most this many hits."},
            "kind": {"type": "string", "enum": ["web", "news"]}},
          "required": ["query"], "additionalProperties": False}}}

**Annotations** supported: ``str``, ``int``, ``float``, ``bool``, ``list[T]``, ``dict[str, T]``,
``Literal[...]`` (of str, int, float or bool values), ``Optional[T]`` / ``T | None`` (``"type": [T, "null"]``),
nested freely. A parameter with a default is not required (the default is not put in the schema).
**Docstrings**: the first paragraph is the description; per-argument descriptions come from a
Google-style ``Args:`` (or ``Arguments:``/``Parameters:``) section, ``name: text`` or
``name (type): text``, or from Sphinx ``:param name: text`` lines; continuation lines are joined.

**Not supported** (:class:`ToolDefinitionError` naming the function and argument): other unions,
bare ``list``/``dict``, ``Any``, dataclasses or other classes, ``*args``/``**kwargs``, missing
annotations, documented arguments that the signature lacks, lambdas and other names that are not
``[A-Za-z0-9_-]{1,64}`` (the OpenAI limit).
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from services.tasks.sandbox_tools import Sandbox, sandbox_param

#: JSON Schema of one value, and the OpenAI ``{"type": "function", ...}`` tool description
Schema = dict[str, Any]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_GOOGLE_HEADERS = {"args:", "arguments:", "parameters:", "params:"}
_GOOGLE_ARG = re.compile(r"(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")
_SPHINX_PARAM = re.compile(r":param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)")


class ToolDefinitionError(TypeError):
    """A function that cannot be offered as a tool as written (the message names function and argument)."""


@dataclass(frozen=True)
class ToolSpec:
    """A function offered as a tool: its name, the function, its OpenAI schema, and whether it is async."""

    name: str
    fn: Callable[..., Any]
    schema: Schema
    is_async: bool
    #: the parameter that takes the episode's sandbox (:mod:`services.tasks.sandbox_tools`), or None
    sandbox_arg: str | None = None


def is_async(fn: Callable[..., Any]) -> bool:
    """True when calling ``fn`` returns an awaitable coroutine (``async def``, also through
    ``functools.partial`` or an object whose ``__call__`` is ``async def``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


# ---------------------------------------------------------------------------------------------------------
# schema


def function_schema(fn: Callable[..., Any]) -> Schema:
    """The OpenAI function-tool schema of ``fn``, from its signature, type hints and docstring."""
    name = getattr(fn, "__name__", "")
    if _NAME.fullmatch(name) is None:
        raise ToolDefinitionError(f"tool name {name!r} of {fn!r} must match [A-Za-z0-9_-]{{1,64}}; "
                                  "define the tool with def and a plain name")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation that names something undefined, or a non-type
        raise ToolDefinitionError(f"tool {name!r}: its type hints cannot be resolved ({exc}); "
                                  "use types importable at module level") from exc
    description, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Schema] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if hints.get(param.name) is Sandbox:
            continue  # given by the episode, not by the model
        where = f"tool {name!r}, argument {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"{where}: *args and **kwargs cannot be described to a model; "
                                      "name every argument")
        if param.name not in hints:
            raise ToolDefinitionError(f"{where}: no type annotation; annotate it (e.g. `{param.name}: str`)")
        schema = annotation_schema(hints[param.name], where)
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    unknown = sorted(set(arg_docs) - set(inspect.signature(fn).parameters))
    if unknown:
        raise ToolDefinitionError(f"tool {name!r}: the docstring documents {', '.join(unknown)}, which the "
                                  f"signature does not have (arguments: {', '.join(properties) or 'none'})")
    return {"type": "function", "function": {
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False},
    }}


def annotation_schema(annotation: Any, where: str) -> Schema:
    """The JSON Schema of one type annotation; :class:`ToolDefinitionError` (naming ``where``) if unsupported."""
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is list and len(args) == 1:
        return {"type": "array", "items": annotation_schema(args[0], f"{where} (list item)")}
    if origin is dict and len(args) == 2:
        if args[0] is not str:
            raise ToolDefinitionError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        return {"type": "object", "additionalProperties": annotation_schema(args[1], f"{where} (dict value)")}
    if origin is Literal:
        return _literal_schema(args, where)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return _nullable(annotation_schema(rest[0], where))
        raise ToolDefinitionError(f"{where}: only Optional[T] / T | None unions are supported, got {annotation!r}")
    hint = " (write list[T] or dict[str, T])" if annotation in (list, dict) else ""
    raise ToolDefinitionError(f"{where}: unsupported annotation {annotation!r}{hint}; supported: str, int, "
                              "float, bool, list[T], dict[str, T], Literal[...], Optional[T]")


def _literal_schema(values: tuple[Any, ...], where: str) -> Schema:
    kinds = {_SCALARS.get(type(v)) for v in values if v is not None}
    if None in kinds or not kinds:
        raise ToolDefinitionError(f"{where}: Literal values must be str, int, float or bool, got {values!r}")
    schema: Schema = {"type": kinds.pop() if len(kinds) == 1 else sorted(kinds),
                      "enum": [v for v in values if v is not None]}
    return _nullable(schema) if None in values else schema


def _nullable(schema: Schema) -> Schema:
    """``schema`` that also admits null (``type`` becomes a list with ``"null"``; an enum gains ``None``)."""
    kind = schema.get("type")
    kinds = list(kind) if isinstance(kind, list) else [kind]
    schema = {**schema, "type": [*kinds, "null"]}
    if "enum" in schema:
        schema["enum"] = [*schema["enum"], None]
    return schema


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) of a cleaned docstring (see the module docstring)."""
    lines = doc.splitlines()
    paragraph: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.lower() in _GOOGLE_HEADERS or stripped.startswith(":"):
            break
        paragraph.append(stripped)
    return " ".join(paragraph), {**_google_args(lines), **_sphinx_args(lines)}


def _google_args(lines: list[str]) -> dict[str, str]:
    """``name (type): text`` entries of an ``Args:`` section, continuation lines (indented deeper) joined."""
    docs: dict[str, str] = {}
    header: int | None = None  # indent of the section header while inside the section
    arg_indent: int | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped.lower() in _GOOGLE_HEADERS:
            header, arg_indent, current = indent, None, None
        elif header is None or not stripped:
            continue
        elif indent <= header:
            header = None  # the next section (Returns:, Raises:) or prose
        elif arg_indent is None or indent <= arg_indent:
            entry = _GOOGLE_ARG.match(stripped)
            if entry is not None:
                current, arg_indent = entry.group(1).lstrip("*"), indent
                docs[current] = entry.group(2).strip()
        elif current is not None:
            docs[current] = f"{docs[current]} {stripped}".strip()
    return docs


def _sphinx_args(lines: list[str]) -> dict[str, str]:
    """``:param [type] name: text`` lines, with the indented lines that follow joined."""
    docs: dict[str, str] = {}
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        entry = _SPHINX_PARAM.match(stripped)
        if entry is not None:
            current = entry.group(1)
            docs[current] = entry.group(2).strip()
        elif not stripped or stripped.startswith(":") or not line[:1].isspace():
            current = None
        elif current is not None:
            docs[current] = f"{docs[current]} {stripped}".strip()
    return docs


# ---------------------------------------------------------------------------------------------------------
# checking calls


def check_call(tools: Mapping[str, ToolSpec], name: str, arguments: Mapping[str, Any]) -> list[str]:
    """Problems with a call of ``name`` with ``arguments`` (an unknown tool, then :func:`check_arguments`)."""
    spec = tools.get(name)
    if spec is None:
        return [f"unknown tool {name!r}; the tools are: {', '.join(sorted(tools)) or '(none)'}"]
    return check_arguments(spec.schema, arguments)


def check_arguments(schema: Schema, arguments: Mapping[str, Any]) -> list[str]:
    """Problems with ``arguments`` for the tool ``schema`` (from :func:`function_schema`); ``[]`` when fine.

    Each problem is a sentence naming the argument (``argument 'limit': expected an integer, got the
    string '5'``), meant as the model's next observation. Ints are accepted for floats; bools are not
    accepted for ints or floats.
    """
    function = schema.get("function", schema)
    tool = function.get("name", "?")
    parameters = function.get("parameters", {})
    properties: dict[str, Schema] = parameters.get("properties", {})
    if not isinstance(arguments, Mapping):
        return [f"tool {tool!r}: arguments must be a JSON object, got {_describe(arguments)}"]
    problems = [
        f"tool {tool!r}: missing required argument {arg!r} ({_type_words(properties.get(arg, {}))})"
        for arg in parameters.get("required", []) if arg not in arguments
    ]
    for arg, value in arguments.items():
        if arg not in properties:
            takes = ", ".join(properties) or "no arguments"
            problems.append(f"tool {tool!r}: unexpected argument {arg!r}; it takes: {takes}")
            continue
        problems.extend(f"tool {tool!r}: {p}" for p in check_value(properties[arg], value, f"argument {arg!r}"))
    return problems


def check_value(schema: Schema, value: Any, where: str) -> list[str]:
    """Problems with one ``value`` against a JSON Schema of the kind :func:`annotation_schema` writes."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if kinds and not any(_is_type(k, value) for k in kinds):
        return [f"{where}: expected {_type_words(schema)}, got {_describe(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: must be one of {', '.join(map(repr, schema['enum']))}, got {_describe(value)}"]
    if isinstance(value, list) and "items" in schema:
        return [p for i, item in enumerate(value) for p in check_value(schema["items"], item, f"{where}[{i}]")]
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        inner = schema["additionalProperties"]
        return [p for k, item in value.items() for p in check_value(inner, item, f"{where}[{k!r}]")]
    return []


def _is_type(kind: str, value: Any) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "null":
        return value is None
    return True  # a type this module never writes: not ours to refuse


_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
          "array": "a list", "object": "an object", "null": "null"}


def _type_words(schema: Schema) -> str:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    words = " or ".join(_WORDS.get(k, str(k)) for k in kinds) or "any value"
    if kinds == ["array"] and "items" in schema:
        words += f" (each item {_type_words(schema['items'])})"
    return words


def _describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:40] + "..."
    words = {bool: "the boolean", int: "the integer", float: "the number", str: "the string",
             list: "the list", dict: "the object", type(None): ""}.get(type(value), type(value).__name__)
    return f"{words} {text}".strip() if value is not None else "null"


# ---------------------------------------------------------------------------------------------------------
# registry


def tools_by_name(functions: Iterable[Callable[..., Any]]) -> dict[str, ToolSpec]:
    """``{name: ToolSpec}`` of ``functions``; :class:`ToolDefinitionError` on a name given twice."""
    specs: dict[str, ToolSpec] = {}
    for fn in functions:
        schema = function_schema(fn)
        name = schema["function"]["name"]
        if name in specs:
            raise ToolDefinitionError(f"two tools are named {name!r} ({specs[name].fn!r} and {fn!r}); "
                                      "tool names must be unique: rename one")
        takes_sandbox = sandbox_param(fn)
        if takes_sandbox is not None and not is_async(fn):
            raise ToolDefinitionError(f"tool {name!r} takes the sandbox ({takes_sandbox!r}) but is not async def: "
                                      "the sandbox handle is asynchronous; make the tool `async def`")
        specs[name] = ToolSpec(name=name, fn=fn, schema=schema, is_async=is_async(fn), sandbox_arg=takes_sandbox)
    return specs
