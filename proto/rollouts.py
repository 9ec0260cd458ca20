"""Finished rollouts: the completions (single- or multi-turn) of one prompt group.

Subject ``rlbus.<run>.rollouts`` — published by rollout workers, consumed by
judges through the durable ``judge`` consumer of stream ROLLOUTS (queue group).

The channel carries :class:`RolloutGroup` messages only: a group's ticket once and one
:class:`RolloutSample` per completion (split into as few parts as fit the message size
limit), so the per-message work on the way to the trainer is paid per group, not per sample.
Readers take :meth:`RolloutGroup.records`: one :class:`Rollout` per sample, the ticket's
fields joined in. A bare ``Rollout`` is what older writers published, one per message, and
an older ``RolloutGroup`` (schema 1) repeated the ticket in every record: decoding turns
either into today's group (:func:`proto.codec.reads_old`), so every reader sees one shape.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from proto import codec
from proto.envelope import Envelope
from proto.prompts import PromptTicket

FAMILY = "rollouts"

FinishReason = Literal["stop", "length", "eos", "turn_limit", "token_budget", "wall_time", "error"]


class Turn(msgspec.Struct, kw_only=True):
    """A span of completion tokens produced by one party.

    ``role="assistant"`` tokens were sampled by the policy and carry behaviour
    logprobs and the weight version of each token; ``role="tool"`` tokens came
    from tool output and are excluded from the loss.

    ``reward`` is the environment's reward for this assistant turn (``services/tasks/env.py``); the judge
    adds the turn rewards of a rollout to its final score (no discounting). None: no turn reward.
    """

    role: Literal["assistant", "tool"]
    token_ids: list[int]
    logprobs: list[float] = []
    versions: list[int] = []
    text: str = ""
    reward: float | None = None


class EpisodeSegment(msgspec.Struct, kw_only=True):
    """One more sequence of an episode whose context was rewritten on the way (a black-box agent that truncated
    or rewrote its history): its own prompt (masked) and turns (``assistant`` trained, ``tool`` masked), trained
    as its own sequence with the episode's reward and advantage."""

    prompt_ids: list[int]
    turns: list[Turn]


class RolloutSample(msgspec.Struct, kw_only=True):
    """What is per sample of a group's completions (the group carries its ticket once)."""

    #: the sample's id (``<run>-<group>-s<i>``); its scored trajectory and its outcome keep it
    id: str
    #: index of this completion inside its group (0 .. group_size-1)
    sample_index: int
    turns: list[Turn]
    finish_reason: FinishReason
    error: str | None = None
    sandbox_id: str | None = None
    worker: str = ""
    #: what this sample adds to the ticket's metadata (e.g. ``sandbox_retries``)
    metadata: dict[str, str] = {}
    #: the prompt this sample's turns follow, when it is not the ticket's: a black-box agent's episode starts
    #: from the prompt its own first call rendered (None: the ticket's ``prompt_ids``)
    prompt_ids: list[int] | None = None
    #: the episode's segments after the first (``prompt_ids`` + ``turns`` are the first), in the order they
    #: started; empty: the episode is one sequence
    extra_segments: list[EpisodeSegment] = []


class Rollout(Envelope, kw_only=True, tag="rollout"):
    """One sample with its ticket's fields: what readers get from :meth:`RolloutGroup.records`
    (``msg_id`` is the sample's id), and the bare record older writers published."""

    task: str
    group_id: str
    prompt_id: str
    #: index of this completion inside its group (0 .. group_size-1)
    sample_index: int
    group_size: int
    prompt_ids: list[int]
    turns: list[Turn]
    finish_reason: FinishReason
    #: the weight version the ticket was admitted at
    policy_version: int
    metadata: dict[str, str] = {}
    is_eval: bool = False
    sandbox_id: str | None = None
    error: str | None = None
    worker: str = ""
    #: the prompt as text (the ticket's ``prompt_text``), for judges that read it (LLM-as-judge)
    prompt_text: str = ""
    #: the episode's segments after the first (see :class:`RolloutSample`)
    extra_segments: list[EpisodeSegment] = []

    def sequences(self) -> list[tuple[list[int], list[Turn]]]:
        """``(prompt_ids, turns)`` of each sequence the episode trains as: the first, then its extra segments."""
        return [(self.prompt_ids, self.turns), *((s.prompt_ids, s.turns) for s in self.extra_segments)]

    def all_turns(self) -> list[Turn]:
        """The turns of every segment, in order."""
        return [turn for _, turns in self.sequences() for turn in turns]

    def completion_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    def text(self) -> str:
        """The turns' text, every segment's in order."""
        return "".join(turn.text for turn in self.all_turns())

    def min_version(self) -> int:
        """Weight version of the oldest policy token over every segment, or policy_version if none."""
        versions = [v for turn in self.all_turns() for v in turn.versions]
        return min(versions) if versions else self.policy_version


def joined(group: Envelope, ticket: PromptTicket, s: RolloutSample) -> Rollout:
    """Sample ``s`` of ``group`` with its ticket's fields (no list is copied)."""
    return Rollout(run_id=group.run_id, msg_id=s.id, created_at=group.created_at, task=ticket.task,
                   group_id=ticket.group_id, prompt_id=ticket.prompt_id, sample_index=s.sample_index,
                   group_size=ticket.group_size,
                   prompt_ids=ticket.prompt_ids if s.prompt_ids is None else s.prompt_ids, turns=s.turns,
                   finish_reason=s.finish_reason, policy_version=ticket.policy_version,
                   metadata={**ticket.metadata, **s.metadata},
                   is_eval=ticket.is_eval, sandbox_id=s.sandbox_id, error=s.error, worker=s.worker,
                   prompt_text=ticket.prompt_text, extra_segments=s.extra_segments)


def split(r: Rollout, ticket: PromptTicket) -> RolloutSample:
    """The per-sample part of ``r`` (its metadata beyond the ticket's)."""
    extra = {k: v for k, v in r.metadata.items() if ticket.metadata.get(k) != v}
    return RolloutSample(id=r.msg_id, sample_index=r.sample_index, turns=r.turns, finish_reason=r.finish_reason,
                         error=r.error, sandbox_id=r.sandbox_id, worker=r.worker, metadata=extra,
                         prompt_ids=None if r.prompt_ids == ticket.prompt_ids else r.prompt_ids,
                         extra_segments=r.extra_segments)


def ticket_of(r: Rollout, msg_id: str) -> PromptTicket:
    """The ticket fields ``r`` carries (the sampling it was generated with is not among them)."""
    return PromptTicket(run_id=r.run_id, msg_id=msg_id, created_at=r.created_at, task=r.task, group_id=r.group_id,
                        prompt_id=r.prompt_id, prompt_ids=r.prompt_ids, prompt_text=r.prompt_text,
                        group_size=r.group_size, policy_version=r.policy_version, metadata=r.metadata,
                        is_eval=r.is_eval)


class TicketGroup(Envelope, kw_only=True):
    """A message of one prompt group's samples: the ticket they were generated for, once (layout 2)."""

    schema: int = 2
    ticket: PromptTicket

    @property
    def group_id(self) -> str:
        return self.ticket.group_id


class RolloutGroup(TicketGroup, kw_only=True, tag="rollout_group"):
    """Rollouts of one prompt group (all of them, or one part when the whole group exceeds the size limit):
    the ticket they were generated for, once, and what is per sample."""

    rollouts: list[RolloutSample]

    def records(self) -> list[Rollout]:
        """One :class:`Rollout` per sample, the ticket's fields joined in."""
        return [joined(self, self.ticket, s) for s in self.rollouts]

    @classmethod
    def of(cls, rollouts: list[Rollout], msg_id: str | None = None) -> RolloutGroup:
        """The group message of ``rollouts`` (samples of one ticket; the first one's ticket fields are kept)."""
        if not rollouts:
            raise ValueError("a rollout group holds at least one rollout")
        first = rollouts[0]
        ticket = ticket_of(first, f"{msg_id or first.msg_id}-ticket")
        return cls(run_id=first.run_id, msg_id=msg_id or first.msg_id, created_at=first.created_at, ticket=ticket,
                   rollouts=[split(r, ticket) for r in rollouts])


class RolloutGroupV1(Envelope, kw_only=True, tag="rollout_group"):
    """The group layout of schema 1 (every rollout repeating its ticket's fields): read, never written."""

    group_id: str
    rollouts: list[Rollout]


codec.reads_old(RolloutGroup, Rollout | RolloutGroupV1, lambda old: RolloutGroup.of(
    [old] if isinstance(old, Rollout) else old.rollouts, msg_id=old.msg_id))
