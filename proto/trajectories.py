"""Scored trajectories: rollouts plus their rewards.

Subject ``rlbus.<run>.trajectories`` — published by judges, consumed by the
trainer through its durable ``trainer`` consumer of stream TRAJECTORIES (the
staleness filter runs on this side).

A judge publishes what it scored of one :class:`~proto.rollouts.RolloutGroup` as one
:class:`ScoredGroup`: the group's ticket once and a :class:`ScoredSample` per sample (its
rollout's per-sample fields and its reward). Readers take :meth:`ScoredGroup.records`: one
:class:`ScoredTrajectory` per sample, its rollout joined with the ticket. Each keeps its sample's
id (``<run>-<group>-s<i>``): outcomes name trajectories, not messages. A bare ``ScoredTrajectory``
(what older writers published) and a schema-1 group decode as today's group.
"""

from __future__ import annotations

import msgspec

from proto import codec
from proto.envelope import Envelope
from proto.rollouts import Rollout, RolloutSample, TicketGroup, joined, split, ticket_of

FAMILY = "trajectories"


class GraderScore(msgspec.Struct, kw_only=True):
    """One grader's verdict: the score in [0, 1], its weight, and why."""

    grader: str
    score: float
    weight: float = 1.0
    explanation: str = ""
    error: str | None = None


class ScoredSample(RolloutSample, kw_only=True):
    """One sample of a scored group: its rollout's per-sample fields and what the judge made of it."""

    reward: float
    scores: list[GraderScore] = []
    judge: str = ""
    #: on-policy distillation (``[distill]``): the teacher's logprob of every token after the prompt, in the
    #: order of the turns (assistant and observation tokens alike); None: the teacher was not asked
    teacher_logprobs: list[float] | None = None


class ScoredTrajectory(Envelope, kw_only=True, tag="scored_trajectory"):
    """One scored sample with its ticket's fields: what readers get from :meth:`ScoredGroup.records`
    (``msg_id`` is the sample's id), and the bare record older writers published."""

    rollout: Rollout
    reward: float
    scores: list[GraderScore] = []
    judge: str = ""
    #: the teacher's logprobs of the tokens after the prompt (on-policy distillation; None: not asked)
    teacher_logprobs: list[float] | None = None


def scored(s: RolloutSample, reward: float, scores: list[GraderScore], judge: str,
           teacher_logprobs: list[float] | None = None) -> ScoredSample:
    """Sample ``s`` with its reward, the graders' scores and (distillation) the teacher's logprobs."""
    return ScoredSample(**msgspec.structs.asdict(s), reward=reward, scores=scores, judge=judge,
                        teacher_logprobs=teacher_logprobs)


class ScoredGroup(TicketGroup, kw_only=True, tag="scored_group"):
    """Scored trajectories of one prompt group (or of one part of it), published by one judge: the ticket
    once, and what is per sample."""

    trajectories: list[ScoredSample]

    def records(self) -> list[ScoredTrajectory]:
        """One :class:`ScoredTrajectory` per sample, its rollout joined with the ticket."""
        return [ScoredTrajectory(run_id=self.run_id, msg_id=s.id, created_at=self.created_at,
                                 rollout=joined(self, self.ticket, s), reward=s.reward, scores=s.scores,
                                 judge=s.judge, teacher_logprobs=s.teacher_logprobs) for s in self.trajectories]

    @classmethod
    def of(cls, trajectories: list[ScoredTrajectory], msg_id: str | None = None) -> ScoredGroup:
        """The group message of ``trajectories`` (samples of one ticket; the first one's ticket fields are
        kept; each sample keeps its trajectory's id)."""
        if not trajectories:
            raise ValueError("a scored group holds at least one trajectory")
        first = trajectories[0]
        ticket = ticket_of(first.rollout, f"{msg_id or first.msg_id}-ticket")
        return cls(run_id=first.run_id, msg_id=msg_id or first.msg_id, created_at=first.created_at, ticket=ticket,
                   trajectories=[scored(msgspec.structs.replace(split(t.rollout, ticket), id=t.msg_id), t.reward,
                                        t.scores, t.judge, t.teacher_logprobs) for t in trajectories])


class ScoredGroupV1(Envelope, kw_only=True, tag="scored_group"):
    """The group layout of schema 1 (every trajectory repeating its ticket's fields): read, never written."""

    group_id: str
    trajectories: list[ScoredTrajectory]


codec.reads_old(ScoredGroup, ScoredTrajectory | ScoredGroupV1, lambda old: ScoredGroup.of(
    [old] if isinstance(old, ScoredTrajectory) else old.trajectories, msg_id=old.msg_id))
