"""Hypothesis strategies for the proto messages: valid ones (from msgspec's own type info, so every
constraint is honoured), random msgpack of any shape, maps shaped like a message with wrong values,
and valid messages with one part broken."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

import proto
from proto import registry

MAX_INT = 2**64 - 1
MIN_INT = -(2**63)
FAMILIES = ("prompts", "outcomes", "rollouts", "trajectories", "heartbeat", "dlq", "metrics", "echo", "sandbox",
            "weights")


def _is_struct(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, msgspec.Struct)


def message_types() -> list[Any]:
    """Every Struct of every proto module, every module-level union of Structs, and each family's tap type."""
    found: dict[str, Any] = {}
    for mod in pkgutil.iter_modules(proto.__path__):
        m = importlib.import_module(f"proto.{mod.name}")
        for name, obj in vars(m).items():
            if _is_struct(obj) and obj.__module__ == m.__name__:
                found[f"{m.__name__}.{name}"] = obj
            elif typing.get_origin(obj) in (typing.Union, types.UnionType) and all(
                    _is_struct(a) for a in typing.get_args(obj)):
                found[f"{m.__name__}.{name}"] = obj
    for family in FAMILIES:
        typ = registry.type_for_subject(f"rlbus.x.{family}")
        if typ is not None and typ not in found.values():
            found[f"family:{family}"] = typ
    return list(found.values())


def type_name(typ: Any) -> str:
    return getattr(typ, "__name__", str(typ))


# --- anything msgpack can carry ------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(MIN_INT, MAX_INT) | st.floats()
           | st.text(max_size=24) | st.binary(max_size=24))

ANY_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=12) | st.integers(MIN_INT, MAX_INT), inner, max_size=6),
    max_leaves=40,
)


def encode_any(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


# --- valid values, from msgspec's type info --------------------------------------------------------


def _int(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else MIN_INT)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else MAX_INT)
    return st.integers(lo, hi)


def _float(t: mi.FloatType) -> st.SearchStrategy[float]:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return st.floats(min_value=lo, max_value=hi, exclude_min=t.gt is not None, exclude_max=t.lt is not None,
                     allow_nan=False, allow_infinity=lo is None and hi is None)


def valid(t: mi.Type, depth: int = 0) -> st.SearchStrategy[Any]:
    """Builtin values (what msgpack carries) that decode as ``t``."""
    small = 3 if depth < 3 else 1
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        return _int(t)
    if isinstance(t, mi.FloatType):
        return _float(t)
    if isinstance(t, mi.StrType):
        if t.pattern:
            return st.from_regex(t.pattern, fullmatch=True)
        return st.text(min_size=t.min_length or 0, max_size=max(t.min_length or 0, min(t.max_length or 16, 16)))
    if isinstance(t, mi.BytesType):
        return st.binary(min_size=t.min_length or 0, max_size=max(t.min_length or 0, 16))
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        lo = t.min_length or 0
        return st.lists(valid(t.item_type, depth + 1), min_size=lo, max_size=max(lo, small))
    if isinstance(t, mi.DictType):
        return st.dictionaries(valid(t.key_type, depth + 1), valid(t.value_type, depth + 1), max_size=small)
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.UnionType):
        return st.one_of([valid(x, depth + 1) for x in t.types])
    if isinstance(t, mi.StructType):
        return _struct(t, depth)
    if isinstance(t, mi.AnyType):
        return ANY_VALUE
    raise TypeError(f"no strategy for {t!r}: extend tests/fuzz/strategies.py")


def _struct(t: mi.StructType, depth: int) -> st.SearchStrategy[dict[str, Any]]:
    required = {f.encode_name: valid(f.type, depth + 1) for f in t.fields if f.required}
    optional = {f.encode_name: valid(f.type, depth + 1) for f in t.fields if not f.required}
    base = st.fixed_dictionaries(required, optional=optional)
    if t.tag_field is not None:
        return base.map(lambda d: {t.tag_field: t.tag, **d})
    return base


def valid_message(typ: Any) -> st.SearchStrategy[dict[str, Any]]:
    """A msgpack-ready dict that decodes as ``typ`` (a Struct or a union of Structs)."""
    return valid(mi.type_info(typ))


def _field_names(info: mi.Type) -> list[tuple[str, Any]]:
    if isinstance(info, mi.StructType):
        out = [(f.encode_name, f.type) for f in info.fields]
        return out + ([(info.tag_field, mi.LiteralType((info.tag,)))] if info.tag_field else [])
    if isinstance(info, mi.UnionType):
        return [x for t in info.types for x in _field_names(t)]
    return []


def shaped_like(typ: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Maps with the message's own keys (and its tag) but values of any type: deep validation paths."""
    names = sorted({name for name, _ in _field_names(mi.type_info(typ))})
    info = mi.type_info(typ)
    tags: list[Any] = []
    for s in (info.types if isinstance(info, mi.UnionType) else (info,)):
        if isinstance(s, mi.StructType) and s.tag_field:
            tags.append((s.tag_field, s.tag))
    keyed = st.dictionaries(st.sampled_from(names) if names else st.text(max_size=8), ANY_VALUE, max_size=len(names) + 2)
    if not tags:
        return keyed
    return st.tuples(keyed, st.sampled_from(tags)).map(lambda kt: {**kt[0], kt[1][0]: kt[1][1]})


#: values a generator seldom reaches: sizes near the limits, extreme numbers
BIG_VALUES = st.sampled_from([
    "x" * 1_000_000, b"\xff" * 1_000_000, [0] * 100_000, {str(i): i for i in range(20_000)},
    2**64 - 1, -(2**63), 1e308, -1e308, float("inf"), float("-inf"), float("nan"), -0.0, "", [], {},
])


@st.composite
def broken_message(draw: st.DrawFn, typ: Any, junk: st.SearchStrategy[Any] = ANY_VALUE,
                   actions: tuple[str, ...] = ("replace", "remove", "junk")) -> dict[str, Any]:
    """A valid message with one value replaced by ``junk``, one key removed, or a junk key added, somewhere inside."""
    msg = draw(valid_message(typ))
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k in list(node):
                paths.append((node, k))
                walk(node[k])
        elif isinstance(node, list):
            for i in range(len(node)):
                paths.append((node, i))
                walk(node[i])

    walk(msg)
    if not paths:
        return msg
    parent, key = draw(st.sampled_from(paths))
    action = draw(st.sampled_from(actions))
    if action == "replace" or (action == "remove" and isinstance(parent, list)):
        parent[key] = draw(junk)
    elif action == "remove":
        del parent[key]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=12))] = draw(junk)
    else:
        parent.append(draw(junk))
    return msg
