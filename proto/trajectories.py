"""Scored trajectories: a rollout plus its reward.

Subject ``rlbus.<run>.trajectories`` — published by judges, consumed by the
trainer through its durable ``trainer`` consumer of stream TRAJECTORIES (the
staleness filter runs on this side).

A judge publishes what it scored of one :class:`~proto.rollouts.RolloutGroup` as one
:class:`ScoredGroup`; a bare :class:`ScoredTrajectory` is a group of one and stays
valid. Each trajectory keeps its own ``msg_id``: outcomes name trajectories, not messages.
"""

from __future__ import annotations

import msgspec

from proto.envelope import Envelope
from proto.rollouts import Rollout

FAMILY = "trajectories"


class GraderScore(msgspec.Struct, kw_only=True):
    """One grader's verdict: the score in [0, 1], its weight, and why."""

    grader: str
    score: float
    weight: float = 1.0
    explanation: str = ""
    error: str | None = None


class ScoredTrajectory(Envelope, kw_only=True, tag="scored_trajectory"):
    rollout: Rollout
    reward: float
    scores: list[GraderScore] = []
    judge: str = ""


class ScoredGroup(Envelope, kw_only=True, tag="scored_group"):
    """Scored trajectories of one prompt group (or of one part of it), published by one judge."""

    group_id: str
    trajectories: list[ScoredTrajectory]

