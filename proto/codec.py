"""msgpack encoding of bus messages, strict decoding with readable errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

#: Largest message a service accepts by default (tensors never travel inside messages).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Longest error text kept from the decoder (msgspec quotes offending values in full)
MAX_REASON_CHARS = 300


def _short(text: str) -> str:
    """``text`` with control characters escaped and cut to MAX_REASON_CHARS (it ends up in logs and dead letters)."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    if len(text) > MAX_REASON_CHARS:
        text = f"{text[:MAX_REASON_CHARS]}... ({len(text)} characters)"
    return text

_encoder = msgspec.msgpack.Encoder()


class DecodeError(ValueError):
    """A payload could not be decoded as the expected message type.

    ``field`` is the JSON-path-like location msgspec reported (``$.policy_version``),
    or ``None`` when the payload was not msgpack at all.
    """

    def __init__(self, type_name: str, reason: str, field: str | None = None) -> None:
        self.type_name = type_name
        self.reason = reason
        self.field = field
        where = f" at field {field}" if field else ""
        super().__init__(f"cannot decode {type_name}{where}: {reason}")


def encode(msg: Any) -> bytes:
    """Encode a message Struct (or any msgspec-encodable value) as msgpack."""
    return _encoder.encode(msg)


#: layouts older writers published that are still read as a current type: type -> (old type(s), upgrade)
_OLD: dict[Any, tuple[Any, Callable[[Any], Any]]] = {}


def reads_old(current: type, old: Any, upgrade: Callable[[Any], Any]) -> None:
    """Let :func:`decode` read payloads of ``old`` (a type or a union of tagged types) where ``current`` is
    asked for, turned into a ``current`` by ``upgrade``: a channel's older messages (a bare record where a
    group travels now, an older group layout) keep decoding, and every reader sees the current shape."""
    _OLD[current] = (old, upgrade)


def decode(data: bytes, type: type[T], *, max_bytes: int | None = MAX_MESSAGE_BYTES) -> T:
    """Strictly decode ``data`` as ``type`` (or as a layout it reads, :func:`reads_old`, upgraded); raise
    :class:`DecodeError` naming the field."""
    name = getattr(type, "__name__", str(type))
    if max_bytes is not None and len(data) > max_bytes:
        raise DecodeError(name, f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgspec.msgpack.decode(data, type=type)
    except msgspec.ValidationError as e:
        if type in _OLD:  # an older layout? (only tried when the current one does not fit)
            old, upgrade = _OLD[type]
            try:
                return upgrade(msgspec.msgpack.decode(data, type=old))
            except (msgspec.ValidationError, ValueError, RecursionError):
                pass  # neither: the error names the current layout's problem
        text = str(e)
        field = None
        if " - at `" in text:
            text, _, rest = text.partition(" - at `")
            field = rest.rstrip("`")
        raise DecodeError(name, _short(text), _short(field) if field else None) from None
    except msgspec.DecodeError as e:
        raise DecodeError(name, _short(f"not valid msgpack ({e})")) from None
    except RecursionError:
        raise DecodeError(name, "nested too deeply") from None


def fit(items: list[T], make: Callable[[list[T]], Any], max_bytes: int) -> list[Any]:
    """``make(items)`` as one message, or as several made of consecutive parts of ``items`` when one would
    encode to more than ``max_bytes`` (halved until each part fits; a single item that does not fit is
    left to the size checks downstream). Costs one encode when the whole fits, as it nearly always does."""
    msg = make(items)
    if len(items) <= 1 or len(_encoder.encode(msg)) <= max_bytes:
        return [msg]
    half = len(items) // 2
    return fit(items[:half], make, max_bytes) + fit(items[half:], make, max_bytes)


def to_builtins(msg: Any) -> Any:
    """A JSON-friendly view of a message (bytes become base64 strings)."""
    return msgspec.to_builtins(msg)
