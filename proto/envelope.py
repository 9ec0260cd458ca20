"""The envelope every bus message carries (docs/ARCHITECTURE.md, "Delivery guarantees").

``run_id`` scopes a message to one run, ``msg_id`` is unique per message and is
also sent as the ``Nats-Msg-Id`` header so JetStream de-duplicates retried
publishes, ``created_at`` is wall-clock seconds since the epoch, and
``schema`` is the version of the message's layout. New fields are only ever
added with defaults, so an older reader keeps decoding newer messages of the
same schema major version. A layout that changes otherwise takes the next
version (its class sets ``schema``; ``RolloutGroup`` and ``ScoredGroup`` are at 2,
the ticket once per group), and proto goes on reading the older layout as the
new one (:func:`proto.codec.reads_old`).
"""

from __future__ import annotations

import time
import uuid

import msgspec

SCHEMA_VERSION = 1


def new_msg_id() -> str:
    """A fresh unique message id (32 hex characters)."""
    return uuid.uuid4().hex


def now() -> float:
    """Wall-clock seconds since the epoch, as stored in ``created_at``."""
    return time.time()


class Envelope(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Fields common to every message. Subclass it; do not instantiate it bare."""

    run_id: str
    msg_id: str = msgspec.field(default_factory=new_msg_id)
    created_at: float = msgspec.field(default_factory=now)
    schema: int = SCHEMA_VERSION
