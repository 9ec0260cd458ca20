"""Finished rollouts: one completion (single- or multi-turn) of one prompt.

Subject ``rlbus.<run>.rollouts`` — published by rollout workers, consumed by
judges through the durable ``judge`` consumer of stream ROLLOUTS (queue group).

A prompt group's rollouts travel together as one :class:`RolloutGroup` (split into
as few parts as fit the message size limit), so the per-message work on the way
to the trainer is paid per group, not per sample; a bare :class:`Rollout` is a
group of one and stays valid on the channel.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from proto.envelope import Envelope

FAMILY = "rollouts"

FinishReason = Literal["stop", "length", "eos", "turn_limit", "token_budget", "wall_time", "error"]


class Turn(msgspec.Struct, kw_only=True):
    """A span of completion tokens produced by one party.

    ``role="assistant"`` tokens were sampled by the policy and carry behaviour
    logprobs and the weight version of each token; ``role="tool"`` tokens came
    from tool output and are excluded from the loss.
    """

    role: Literal["assistant", "tool"]
    token_ids: list[int]
    logprobs: list[float] = []
    versions: list[int] = []
    text: str = ""


class Rollout(Envelope, kw_only=True, tag="rollout"):
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

    def completion_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    def text(self) -> str:
        return "".join(turn.text for turn in self.turns)

    def min_version(self) -> int:
        """Weight version of the oldest policy token, or policy_version if none."""
        versions = [v for turn in self.turns for v in turn.versions]
        return min(versions) if versions else self.policy_version


class RolloutGroup(Envelope, kw_only=True, tag="rollout_group"):
    """Rollouts of one prompt group (all of them, or one part when the whole group exceeds the size limit)."""

    group_id: str
    rollouts: list[Rollout]

