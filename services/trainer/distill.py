"""On-policy distillation: per-token advantages from a teacher's logprobs of the student's own samples.

The student samples a completion ``y`` (the rollout); a teacher scores every sampled token. The per-token
advantage is the negative reverse KL of the sampled token, optionally mixed with the task's group advantage::

    A_t = kl_coef * (log pi_teacher(y_t | x, y_<t) - log pi_student(y_t | x, y_<t))  +  reward_weight * A_group

1. ``log pi_student`` is the behaviour logprob the engine recorded when it sampled ``y_t`` (the policy that
   generated the sample, as in on-policy distillation with a sampling client): no extra forward pass. The
   trainer's importance weights (``loss.is_mode``) correct for the engine/trainer gap as for any advantage.
2. ``A_group`` is GRPO's group-normalised advantage of the sample's reward (:func:`loss.group_advantages`);
   ``reward_weight = 0`` is pure distillation, ``kl_coef = 0`` plain GRPO.
3. Tokens outside the loss mask (tool output, padding) get advantage 0; their teacher logprobs are not read.

The advantages carry no gradient: the policy-gradient surrogate of :func:`loss.grpo_loss` with per-token
advantages ``[B, T]`` minimises the reverse KL to the teacher on the student's own distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from proto.trajectories import ScoredTrajectory


class DistillInputError(ValueError):
    """Teacher logprobs that do not match the sample (missing, wrong length, not finite)."""


def token_advantages(
    teacher_logprobs: Sequence[Sequence[float]],
    behaviour_logprobs: Sequence[Sequence[float]],
    masks: Sequence[Sequence[int]],
    group_advantages: Sequence[float],
    *,
    kl_coef: float = 1.0,
    reward_weight: float = 0.0,
) -> list[list[float]]:
    """Per-token advantages ``A_t`` of each completion (the module docstring), as lists (one per completion,
    as long as its completion).

    Raises:
        DistillInputError: a completion's teacher logprobs are not one finite number per token.
    """
    if not len(teacher_logprobs) == len(behaviour_logprobs) == len(masks) == len(group_advantages):
        raise DistillInputError(f"{len(teacher_logprobs)} teacher rows, {len(behaviour_logprobs)} behaviour rows, "
                                f"{len(masks)} masks and {len(group_advantages)} group advantages: expected one each")
    out = []
    for i, (teacher, behaviour, mask, a_group) in enumerate(zip(teacher_logprobs, behaviour_logprobs, masks,
                                                                group_advantages, strict=True)):
        if not len(teacher) == len(behaviour) == len(mask):
            raise DistillInputError(f"completion {i}: {len(teacher)} teacher logprobs for {len(mask)} tokens")
        t = torch.tensor(teacher, dtype=torch.float64)
        m = torch.tensor(mask, dtype=torch.float64)
        if not bool(torch.isfinite(t[m > 0]).all()):
            raise DistillInputError(f"completion {i}: a teacher logprob of a loss token is not finite")
        b = torch.tensor(behaviour, dtype=torch.float64)
        reverse_kl = torch.where(m > 0, t - b, torch.zeros_like(t))  # 0 off the mask, whatever was sent there
        out.append(((kl_coef * reverse_kl + reward_weight * a_group) * m).tolist())
    return out


def distill_figures(teacher_logprobs: Sequence[Sequence[float]], behaviour_logprobs: Sequence[Sequence[float]],
                    masks: Sequence[Sequence[int]]) -> dict[str, float]:
    """The batch's distance to the teacher, over its loss tokens: ``distill/reverse_kl``, the mean of
    ``log pi_student - log pi_teacher`` of the sampled tokens (a one-sample estimate of ``KL(pi_student ||
    pi_teacher)`` per token, what distillation drives down), and ``distill/teacher_logprob``, the teacher's mean
    logprob of them. Empty when no token carries loss."""
    n, kl, teacher = 0, 0.0, 0.0
    for t_row, b_row, m_row in zip(teacher_logprobs, behaviour_logprobs, masks, strict=True):
        for t, b, m in zip(t_row, b_row, m_row, strict=False):
            if m > 0:
                n, kl, teacher = n + 1, kl + (b - t), teacher + t
    return {"distill/reverse_kl": kl / n, "distill/teacher_logprob": teacher / n} if n else {}


def pad_token_advantages(rows: Sequence[Sequence[float]], width: int, device: torch.device | str = "cpu") -> Tensor:
    """``[B, width]`` float32, each row right-padded with 0 (or cut to ``width``)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for k, row in enumerate(rows):
        n = min(len(row), width)
        out[k, :n] = torch.tensor(list(row[:n]), dtype=torch.float32)
    return out.to(device)


def missing_teacher(trajectory: ScoredTrajectory) -> str:
    """Why ``trajectory`` cannot be trained with distillation (its teacher logprobs are missing or do not fit its
    tokens), or ``""`` when it can."""
    if trajectory.rollout.extra_segments:
        return (f"an episode of {1 + len(trajectory.rollout.extra_segments)} segments: on-policy distillation "
                "trains episodes of one sequence only (the teacher scores one sequence per sample)")
    tokens = sum(len(turn.token_ids) for turn in trajectory.rollout.turns)
    teacher = trajectory.teacher_logprobs
    if teacher is None:
        return ("no teacher logprobs: distill.enabled but the judge sent none (a judge without [distill], or "
                "this sample was scored before distillation was turned on)")
    if len(teacher) != tokens:
        return f"teacher logprobs do not fit: {len(teacher)} for {tokens} tokens"
    return ""


def fail_missing_teacher(samples: Sequence[Any]) -> None:
    """Mark each sample (an admission ``Sample``) whose teacher logprobs are missing or do not fit as a failed
    rollout with the reason, so the step drops it like any failed rollout instead of training on it."""
    for s in samples:
        if not s.item.rollout.error and (why := missing_teacher(s.item)):
            s.item = msgspec.structs.replace(s.item, rollout=msgspec.structs.replace(s.item.rollout, error=why))
