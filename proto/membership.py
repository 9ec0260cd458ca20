"""Membership and heartbeats.

Subject ``rlbus.<run>.heartbeat.<service>`` — published by every service every
few seconds, read by ``rlbus tap``/``rlbus status`` and the launcher. The same
Heartbeat is put into KV bucket ``rlbus_members`` under key
``<run>.<service>.<instance>`` (the bucket's max_age makes dead members vanish).
"""

from __future__ import annotations

from typing import Literal

from proto.envelope import Envelope

FAMILY = "heartbeat"
MEMBERS_BUCKET = "rlbus_members"

State = Literal["starting", "waiting", "running", "draining", "stopped"]


class Heartbeat(Envelope, kw_only=True, tag="heartbeat"):
    service: str
    instance: str
    host: str
    pid: int
    state: State
    started_at: float
    #: small numeric gauges (pending requests, step, ...), named by path
    metrics: dict[str, float] = {}


def member_key(run_id: str, service: str, instance: str) -> str:
    return f"{run_id}.{service}.{instance}"
