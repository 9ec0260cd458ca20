"""Trajectory outcomes: what became of every scored trajectory.

Subject ``rlbus.<run>.outcomes`` — published by the trainer for every trajectory
it takes off the stream (trained in step N, dropped for staleness with the
reason, or used for evaluation), stored by stream OUTCOMES. Together with the
TRAJECTORIES stream this gives the accounting identity: every trajectory ever
published is trained, dropped with a recorded reason, or still pending.

The trainer records the outcomes it decides together (a step's trained batch, a
dropped group) as one :class:`OutcomeBatch`, the channel's only message; a bare
:class:`TrajectoryOutcome` (what older writers published) decodes as a batch of one.
"""

from __future__ import annotations

from typing import Literal

from proto import codec
from proto.envelope import Envelope

FAMILY = "outcomes"

Outcome = Literal["trained", "dropped", "eval"]


class TrajectoryOutcome(Envelope, kw_only=True, tag="trajectory_outcome"):
    trajectory_id: str
    group_id: str
    outcome: Outcome
    reason: str = ""
    #: trainer step that used it (trained) or the step current when it was dropped
    step: int
    #: the trainer's weight version at that moment, and the trajectory's oldest token version
    version: int
    sample_version: int
    #: trained: its position in the step's batch (``rlbus replay`` rebuilds the batch in this order); else -1
    batch_index: int = -1


class OutcomeBatch(Envelope, kw_only=True, tag="outcome_batch"):
    """Outcomes decided together: a step's trained batch, a dropped group, an eval group."""

    outcomes: list[TrajectoryOutcome]

    def records(self) -> list[TrajectoryOutcome]:
        return list(self.outcomes)


codec.reads_old(OutcomeBatch, TrajectoryOutcome, lambda old: OutcomeBatch(
    run_id=old.run_id, msg_id=old.msg_id, created_at=old.created_at, outcomes=[old]))

