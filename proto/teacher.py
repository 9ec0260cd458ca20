"""Teacher logprobs for on-policy distillation: the teacher service scores the student's sampled tokens.

Subject ``rlbus.<run>.teacher.logprobs`` — core NATS request/reply. Requested by whoever needs a teacher's
logprobs of finished samples (the judge, for distillation), answered by one teacher worker of the queue group
``teacher`` (any worker of the fleet serves any request). Requests are at most once: the requester bounds its
wait and decides what becomes of a sample the teacher did not score (it is never trained on without them).
"""

from __future__ import annotations

import msgspec

from proto.envelope import Envelope

FAMILY = "teacher"
#: the queue group of the teacher workers of a run
QUEUE_GROUP = "teacher"


class TeacherSequence(msgspec.Struct, kw_only=True):
    """One sample to score: the prompt it was conditioned on and the tokens that followed it."""

    prompt_ids: list[int]
    #: every token after the prompt, in order (assistant and observation tokens alike)
    completion_ids: list[int]


class TeacherRequest(Envelope, kw_only=True, tag="teacher_request"):
    """Score these sequences: ``log p_teacher(completion[j] | prompt, completion[:j])`` for every ``j``."""

    sequences: list[TeacherSequence]
    #: logits are divided by this before the softmax (the temperature the student sampled at)
    temperature: float = 1.0


class TeacherReply(Envelope, kw_only=True, tag="teacher_reply"):
    """The teacher's logprobs, one list per requested sequence (as long as its completion), or why not."""

    logprobs: list[list[float]] = []
    #: empty on success; otherwise why nothing was scored (the requester does not train on these samples)
    error: str = ""
    #: which teacher answered (its model directory), for the record
    teacher: str = ""
