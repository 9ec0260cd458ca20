"""Prompt tickets: the trainer's admitted work for rollout engines.

Subject ``rlbus.<run>.prompts`` — published by the trainer (admission control),
consumed by rollout workers through the durable ``rollout`` consumer of stream
PROMPTS (a shared work queue: each ticket goes to one worker).
"""

from __future__ import annotations

import msgspec

from proto.envelope import Envelope

FAMILY = "prompts"


class Sampling(msgspec.Struct, kw_only=True):
    """How to sample completions for a ticket."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []


class PromptTicket(Envelope, kw_only=True, tag="prompt_ticket"):
    """One prompt group: the rollout worker generates ``group_size`` completions."""

    task: str
    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    prompt_text: str = ""
    group_size: int
    #: the trainer's weight version when this ticket was admitted
    policy_version: int
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    #: task-specific data the judge needs (e.g. the expected answer), opaque to rollout
    metadata: dict[str, str] = {}
    #: eval tickets are scored and reported but never trained on
    is_eval: bool = False
