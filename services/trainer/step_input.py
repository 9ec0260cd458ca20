"""One optimiser step's batch as the learner takes it: scored trajectories turned into plain lists (prompts,
completions, loss masks, behaviour logprobs) with their group-normalised advantages, loss weights and the
batch's loss normaliser. Plain lists, because rank 0 sends the step input to the other ranks of a trainer
(:mod:`services.trainer.ranks`) and :mod:`services.launcher.replay` rebuilds it from a run's stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from proto.trajectories import ScoredTrajectory
from services.runtime.config import DistillSection
from services.trainer.config import TrainerConfig
from services.trainer.distill import distill_figures, token_advantages
from services.trainer.loss import group_advantages


def completion_tensors(batch: list[ScoredTrajectory]) -> tuple[list[list[int]], list[list[int]], list[list[int]],
                                                                 list[list[float]]]:
    """Per trajectory: prompt ids, completion ids, loss mask (0 on tool tokens), behaviour logprobs."""
    prompts, completions, masks, behaviour = [], [], [], []
    for t in batch:
        ids: list[int] = []
        mask: list[int] = []
        blp: list[float] = []
        for turn in t.rollout.turns:
            ids += turn.token_ids
            if turn.role == "assistant":
                mask += [1] * len(turn.token_ids)
                lp = list(turn.logprobs) + [0.0] * (len(turn.token_ids) - len(turn.logprobs))
                blp += lp[: len(turn.token_ids)]
            else:
                mask += [0] * len(turn.token_ids)
                blp += [0.0] * len(turn.token_ids)
        prompts.append(list(t.rollout.prompt_ids))
        completions.append(ids)
        masks.append(mask)
        behaviour.append(blp)
    return prompts, completions, masks, behaviour


@dataclass
class StepInput:
    """One step's batch as plain lists (what rank 0 sends to the other ranks)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    masks: list[list[int]]
    behaviour: list[list[float]]
    #: group-normalised advantages, computed over the whole batch
    advantages: list[float]
    rewards: list[float]
    #: the loss normaliser of the whole batch (completions, or tokens, that carry loss)
    total: float
    #: per-completion loss weights (``loss.staleness_decay``); empty: all 1
    weights: list[float] = field(default_factory=list)
    #: figures of the batch's shaping (``overlong/...``), reported with the step's metrics
    figures: dict[str, float] = field(default_factory=dict)
    #: on-policy distillation: per-token advantages (one list per completion, :mod:`services.trainer.distill`),
    #: used instead of ``advantages``; empty: none
    token_advantages: list[list[float]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: list[ScoredTrajectory], cfg: TrainerConfig, distill: DistillSection | None = None) -> StepInput:
        """The step input of ``batch``; with ``distill`` enabled, its per-token advantages from each trajectory's
        teacher logprobs (every trajectory must carry them: the trainer drops those that do not first)."""
        loss = cfg.loss
        prompts, completions, masks, behaviour = completion_tensors(batch)
        rewards = torch.tensor([t.reward for t in batch], dtype=torch.float32)
        # 1. overlong shaping: the soft penalty on the rewards, truncated completions out of the loss
        penalties = overlong_penalties([sum(m) for m in masks], cfg.sampling.max_new_tokens, loss.overlong_buffer,
                                       loss.overlong_penalty)
        truncated = [t.rollout.finish_reason in TRUNCATED for t in batch]
        if loss.mask_truncated:
            masks = [[0] * len(m) if cut else m for m, cut in zip(masks, truncated, strict=True)]
        n = max(len(batch), 1)
        figures = {"overlong/truncated_frac": sum(truncated) / n}
        if loss.overlong_buffer:
            figures["overlong/penalty_mean"] = sum(penalties) / n
            figures["overlong/penalised_frac"] = sum(1 for p in penalties if p < 0) / n
        # 2. group-normalised advantages, over whole groups (the penalty shapes them; the rewards reported are
        # the task's)
        shaped = rewards + torch.tensor(penalties, dtype=torch.float32)
        advantages = group_advantages(shaped, [t.rollout.group_id for t in batch], normalize_std=bool(loss.normalize_std))
        weights: list[float] = []
        if loss.staleness_decay < 1.0:
            weights = [loss.staleness_decay ** k for k in behind_freshest(batch)]
        tokens: list[list[float]] = []
        if distill is not None and distill.enabled:  # 3. per token: kl_coef * reverse KL + reward_weight * A_group
            teacher = [t.teacher_logprobs or [] for t in batch]
            tokens = token_advantages(teacher, behaviour, masks, advantages.tolist(),
                                      kl_coef=distill.kl_coef, reward_weight=distill.reward_weight)
            figures.update(distill_figures(teacher, behaviour, masks))
        return cls(prompts, completions, masks, behaviour, advantages.tolist(), rewards.tolist(),
                   loss_total(masks, range(len(masks)), str(loss.aggregation)), weights, figures, tokens)

    @property
    def lengths(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True)]


def behind_freshest(batch: list[ScoredTrajectory]) -> list[int]:
    """Per trajectory, the versions its oldest token is behind the batch's freshest sample (0 for the freshest):
    what ``loss.staleness_decay`` weighs, unlike the trainer's ``version_lag`` (behind the trainer's version)."""
    versions = [t.rollout.min_version() for t in batch]
    newest = max(versions, default=0)
    return [newest - v for v in versions]


#: the finish reasons of a completion cut by the token limit (``loss.mask_truncated``)
TRUNCATED = ("length", "token_budget")


def overlong_penalties(lengths: list[int], limit: int, buffer: int, penalty: float) -> list[float]:
    """DAPO's soft overlong punishment per completion of ``lengths`` policy tokens: 0 up to ``limit - buffer``
    tokens, then falling linearly to ``-penalty`` at ``limit`` (and beyond)::

        R(L) = 0                                       L <= limit - buffer
             = (limit - buffer - L) / buffer * penalty  limit - buffer < L <= limit
             = -penalty                                 L > limit

    ``buffer`` 0: no penalty."""
    if not buffer:
        return [0.0] * len(lengths)
    return [-penalty * min(max(n - (limit - buffer), 0), buffer) / buffer for n in lengths]


def loss_total(masks: list[list[int]], rows: Any, aggregation: str) -> float:
    """The loss normaliser of ``rows``: completions with a loss token (the seq_mean aggregations) or loss tokens."""
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return float(sum(1 for i in rows if sum(masks[i]) > 0))
    return float(sum(sum(masks[i]) for i in rows))
