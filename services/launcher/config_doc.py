"""``docs/CONFIG.md``: the configuration reference, generated from the typed run file.

Every key of :class:`~services.launcher.runfile.RunFile` with its type, default and the ``#:`` comment on its
field, section by section; a choice by ``type`` (the weight transport, stores, engines, graders) lists each
variant's keys. ``rlbus config doc`` writes the page, ``rlbus config doc --check`` fails when it is stale
(and a test does the same), so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from services.launcher.runfile import RunFile

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "CONFIG.md"

HEADER = """\
# Configuration reference

Generated from the typed run file (`services/launcher/runfile.py` and the config structs it names) by
`rlbus config doc`; a test fails when this page is stale. Prose about the run file, how values are
overridden (`RLBUS__SECTION__KEY` variables, `--set section.key=value`) and moved keys:
[configuration.md](configuration.md). `rlbus config show FILE` prints a run file with every default
resolved.

A key that takes one of several shapes chosen by `type` lists each shape's keys under it.
"""


def field_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comment lines above each field of ``cls`` or of the struct class that declares it."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if _is_struct(base) and base is not msgspec.Struct:
            out.update({k: v for k, v in _own_comments(base).items() if v or k not in out})
    return out


def _own_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comment lines above each field ``cls`` itself declares, joined into one sentence."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    out: dict[str, str] = {}
    previous: tuple[str, int] | None = None  # (comment, last line) of the field above
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if not isinstance(target, ast.Name):
            previous = None
            continue
        comment: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        text = " ".join(comment).replace("``", "`")
        if not text and previous is not None and previous[1] == node.lineno - 1:
            text = previous[0]  # a field right below another shares its comment (user / password)
        out[target.id] = text
        previous = (text, node.end_lineno or node.lineno)
    return out


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


def _args(t: Any) -> tuple[Any, ...]:
    return typing.get_args(t)


def _strip(t: Any) -> Any:
    """``Annotated[X, ...]`` -> X."""
    while typing.get_origin(t) is typing.Annotated:
        t = _args(t)[0]
    return t


def _variants(t: Any) -> list[type]:
    """The struct choices of a union field (``A | B | None`` -> [A, B])."""
    t = _strip(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return [a for a in _args(t) if _is_struct(_strip(a))]
    return [t] if _is_struct(t) else []


def _list_items(t: Any) -> list[type]:
    """The struct of a list-of-tables field (``list[A] | None`` -> [A]): its entries are ``[[key]]`` tables."""
    t = _strip(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return [s for a in _args(t) for s in _list_items(a)]
    if typing.get_origin(t) is list and _is_struct(_strip(_args(t)[0])):
        return [_strip(_args(t)[0])]
    return []


def type_name(t: Any) -> str:
    t = _strip(t)
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in _args(t))
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in _args(t))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in _args(t))}]"
    if _is_struct(t):
        tag = t.__struct_config__.tag
        return f'{{ type = "{tag}" }}' if isinstance(tag, str) else "table"
    if t is type(None):
        return "none"
    return getattr(t, "__name__", str(t))


def default_text(field: msgspec.inspect.Field) -> str:
    if field.required:
        return "*required*"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if isinstance(value, msgspec.Struct):
        return "(table)"
    return f"`{msgspec.json.encode(value).decode()}`"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def section(cls: type, path: str, out: list[str], level: int = 2, array: bool = False) -> None:
    """The rows of ``cls``'s plain keys, then a subsection per table-valued key (``array``: the entries of a
    list of tables, headed ``[[path]]``)."""
    hints, comments = _hints(cls), field_comments(cls)
    fields = msgspec.inspect.type_info(cls).fields  # type: ignore[attr-defined]
    tag = cls.__struct_config__.tag  # type: ignore[attr-defined]
    doc = inspect.getdoc(cls) or ""
    head = f"[[{path}]]" if array else f"[{path}]"
    out += [f"{'#' * min(level, 6)} `{head}`" + (f' (`type = "{tag}"`)' if isinstance(tag, str) else ""), ""]
    if doc and doc != inspect.getdoc(msgspec.Struct):
        out += [doc.split("\n\n")[0].replace("\n", " ").replace("``", "`"), ""]
    nested: list[tuple[str, Any]] = []
    arrays: list[tuple[str, type]] = []
    rows = []
    for f in fields:
        t = hints[f.name]
        arrays += [(f.name, item) for item in _list_items(t)]
        variants = _variants(t)
        if variants and not f.required and typing.get_origin(_strip(t)) not in (list, dict):
            nested.append((f.name, t))
        rows.append(f"| `{f.name}` | {type_name(t)} | {default_text(f)} | {comments.get(f.name, '')} |")
    if rows:
        out += ["| key | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    for name, t in nested:
        for v in _variants(t):
            section(v, f"{path}.{name}" if path else name, out, level + 1)
    for name, item in arrays:
        section(item, f"{path}.{name}" if path else name, out, level + 1, array=True)


def render() -> str:
    out = [HEADER]
    hints = _hints(RunFile)
    for f in msgspec.inspect.type_info(RunFile).fields:  # type: ignore[attr-defined]
        t = hints[f.name]
        if f.name == "services":
            for svc in msgspec.inspect.type_info(_strip(t)).fields:  # type: ignore[attr-defined]
                section(_hints(_strip(t))[svc.name], f"services.{svc.name}", out)
            continue
        bare = _strip(t)
        if typing.get_origin(bare) is dict and _is_struct(_strip(_args(bare)[1])):  # a table per name ([placement])
            section(_strip(_args(bare)[1]), f"{f.name}.<name>", out)
            continue
        for v in _variants(t):
            section(v, f.name, out)
    return "\n".join(out).rstrip() + "\n"


def main(check: bool) -> int:
    text = render()
    if check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `rlbus config doc` and commit it")
            return 1
        print(f"{DOC} is current")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC} ({text.count(chr(10))} lines)")
    return 0
