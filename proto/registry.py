"""Which message type travels on which subject family (used by ``rlbus tap``)."""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from proto import accounting, deadletter, echo, membership, metrics, prompts, rollouts, trajectories
from proto.codec import DecodeError, decode
from proto.subjects import family_of

_BY_FAMILY: dict[str, Any] = {
    prompts.FAMILY: prompts.PromptTicket,
    accounting.FAMILY: accounting.TrajectoryOutcome,
    rollouts.FAMILY: rollouts.Rollout,
    trajectories.FAMILY: trajectories.ScoredTrajectory,
    membership.FAMILY: membership.Heartbeat,
    deadletter.FAMILY: deadletter.DeadLetter,
    metrics.FAMILY: metrics.MetricsReport,
    echo.FAMILY: echo.EchoRequest | echo.EchoReply,
}

# families defined by optional proto modules (added by their issues); loaded if present
_OPTIONAL = {"sandbox": "proto.sandbox", "weights": "proto.weights"}


def type_for_subject(subject: str) -> Any | None:
    fam = family_of(subject)
    if fam is None:
        return None
    if fam in _BY_FAMILY:
        return _BY_FAMILY[fam]
    mod_name = _OPTIONAL.get(fam)
    if mod_name:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            return None
        return getattr(mod, "TAP_TYPE", None)
    return None


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
