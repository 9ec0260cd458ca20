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
from services.trainer.distill import token_advantages
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
    #: on-policy distillation: per-token advantages (one list per completion, :mod:`services.trainer.distill`),
    #: used instead of ``advantages``; empty: none
    token_advantages: list[list[float]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: list[ScoredTrajectory], cfg: TrainerConfig, distill: DistillSection | None = None) -> StepInput:
        """The step input of ``batch``; with ``distill`` enabled, its per-token advantages from each trajectory's
        teacher logprobs (every trajectory must carry them: the trainer drops those that do not first)."""
        rewards = torch.tensor([t.reward for t in batch], dtype=torch.float32)
        # 1. group-normalised advantages, over whole groups
        loss = cfg.loss
        advantages = group_advantages(rewards, [t.rollout.group_id for t in batch], normalize_std=loss.normalize_std)
        prompts, completions, masks, behaviour = completion_tensors(batch)
        weights: list[float] = []
        if loss.staleness_decay < 1.0:
            weights = [loss.staleness_decay ** k for k in behind_freshest(batch)]
        tokens: list[list[float]] = []
        if distill is not None and distill.enabled:  # 2. per token: kl_coef * reverse KL + reward_weight * A_group
            tokens = token_advantages([t.teacher_logprobs or [] for t in batch], behaviour, masks, advantages.tolist(),
                                      kl_coef=distill.kl_coef, reward_weight=distill.reward_weight)
        return cls(prompts, completions, masks, behaviour, advantages.tolist(), rewards.tolist(),
                   loss_total(masks, range(len(masks)), loss.aggregation), weights, tokens)

    @property
    def lengths(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True)]


def behind_freshest(batch: list[ScoredTrajectory]) -> list[int]:
    """Per trajectory, the versions its oldest token is behind the batch's freshest sample (0 for the freshest):
    what ``loss.staleness_decay`` weighs, unlike the trainer's ``version_lag`` (behind the trainer's version)."""
    versions = [t.rollout.min_version() for t in batch]
    newest = max(versions, default=0)
    return [newest - v for v in versions]


def loss_total(masks: list[list[int]], rows: Any, aggregation: str) -> float:
    """The loss normaliser of ``rows``: completions with a loss token (seq_mean_token_mean) or loss tokens."""
    if aggregation == "seq_mean_token_mean":
        return float(sum(1 for i in rows if sum(masks[i]) > 0))
    return float(sum(sum(masks[i]) for i in rows))
