"""Which message type travels on which subject (used by ``rlbus tap``), read from the channel table."""

from __future__ import annotations

import typing
from typing import Any

import msgspec

from proto import catalog
from proto.codec import DecodeError, decode
from proto.subjects import family_of


def channel_for_subject(subject: str) -> catalog.Channel | None:
    """The channel a concrete subject belongs to, or None."""
    return next((c for c in catalog.CHANNELS.values() if c.matches(subject)), None)


def _family_type(family: str) -> Any | None:
    found = dict.fromkeys(t for c in catalog.CHANNELS.values() if c.family == family for t in c.types)
    return typing.Union[tuple(found)] if found else None  # noqa: UP007


def type_for_subject(subject: str) -> Any | None:
    """The channel's message type; for a subject of no channel, every type of its family (or None)."""
    channel = channel_for_subject(subject)
    if channel is not None:
        return channel.msg_type
    fam = family_of(subject)
    return None if fam is None else _family_type(fam)


def decode_any(subject: str, data: bytes) -> Any:
    """Decode by subject family; fall back to schema-less msgpack; raise DecodeError otherwise."""
    typ = type_for_subject(subject)
    if typ is not None:
        try:
            return decode(data, typ, max_bytes=None)
        except DecodeError:
            pass
    try:
        return msgspec.msgpack.decode(data)
    except msgspec.DecodeError as e:
        raise DecodeError("message", f"not msgpack ({e})") from None
    except RecursionError:
        raise DecodeError("message", "nested too deeply") from None
