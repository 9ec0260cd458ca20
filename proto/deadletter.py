"""Dead letters: messages a service could not process, with the reason.

Subject ``rlbus.<run>.dlq.<family>`` (``rlbus._unknown.dlq.<family>`` when the
run cannot be read) — published by the shared consume loop of any service,
stored by stream DLQ for people and tools to inspect; nothing consumes it
automatically.
"""

from __future__ import annotations

from proto.envelope import Envelope

FAMILY = "dlq"


class DeadLetter(Envelope, kw_only=True, tag="dead_letter"):
    service: str
    original_subject: str
    reason: str
    error_type: str
    stream: str = ""
    stream_seq: int = 0
    deliveries: int = 0
    headers: dict[str, str] = {}
    #: the original payload, untouched
    payload: bytes = b""
