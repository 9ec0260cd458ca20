"""One optimiser step's batch as the learner takes it: scored trajectories turned into plain lists (prompts,
completions, loss masks, behaviour logprobs) with their group-normalised advantages, loss weights and the
batch's loss normaliser. Plain lists, because rank 0 sends the step input to the other ranks of a trainer
(:mod:`services.trainer.ranks`) and :mod:`services.launcher.replay` rebuilds it from a run's stream.

**Rows and episodes.** A row is one sequence. An episode is one row, except an episode of several segments (a
black-box agent that rewrote its history: ``Rollout.extra_segments``), which is one row per segment, each with
its own prompt and mask. Everything per episode is computed per episode and copied to its rows: the reward, the
group advantage (the group is still the prompt group of episodes; a segment is never a group member), the
overlong penalty (on all its generated tokens), ``mask_truncated`` and the staleness decay (on its oldest token
over every segment). ``episode_tokens`` tells the loss how many loss tokens each row's episode has, so that the
``seq_mean`` aggregations count an episode once however many segments it has (:mod:`services.trainer.loss`).
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
    """Per row (a trajectory's sequence: one, or one per segment, in :func:`row_episodes`' order): prompt ids,
    completion ids, loss mask (0 on tool tokens), behaviour logprobs."""
    prompts, completions, masks, behaviour = [], [], [], []
    for t in batch:
        for prompt_ids, turns in t.rollout.sequences():
            ids: list[int] = []
            mask: list[int] = []
            blp: list[float] = []
            for turn in turns:
                ids += turn.token_ids
                if turn.role == "assistant":
                    mask += [1] * len(turn.token_ids)
                    lp = list(turn.logprobs) + [0.0] * (len(turn.token_ids) - len(turn.logprobs))
                    blp += lp[: len(turn.token_ids)]
                else:
                    mask += [0] * len(turn.token_ids)
                    blp += [0.0] * len(turn.token_ids)
            prompts.append(list(prompt_ids))
            completions.append(ids)
            masks.append(mask)
            behaviour.append(blp)
    return prompts, completions, masks, behaviour


def row_episodes(batch: list[ScoredTrajectory]) -> list[int]:
    """Per row of :func:`completion_tensors`, the index in ``batch`` of the trajectory (episode) it belongs to."""
    return [i for i, t in enumerate(batch) for _ in range(1 + len(t.rollout.extra_segments))]


@dataclass
class StepInput:
    """One step's batch as plain lists (what rank 0 sends to the other ranks)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    masks: list[list[int]]
    behaviour: list[list[float]]
    #: per row, its episode's group-normalised advantage, computed over the whole batch
    advantages: list[float]
    #: per episode (trajectory), its reward
    rewards: list[float]
    #: the loss normaliser of the whole batch (episodes, or tokens, that carry loss)
    total: float
    #: per-completion loss weights (``loss.staleness_decay``); empty: all 1
    weights: list[float] = field(default_factory=list)
    #: figures of the batch's shaping (``overlong/...``), reported with the step's metrics
    figures: dict[str, float] = field(default_factory=dict)
    #: on-policy distillation: per-token advantages (one list per completion, :mod:`services.trainer.distill`),
    #: used instead of ``advantages``; empty: none
    token_advantages: list[list[float]] = field(default_factory=list)
    #: per row, the loss tokens of its whole episode (an episode of several segments is several rows); empty:
    #: every row is an episode of its own
    episode_tokens: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, batch: list[ScoredTrajectory], cfg: TrainerConfig, distill: DistillSection | None = None) -> StepInput:
        """The step input of ``batch``; with ``distill`` enabled, its per-token advantages from each trajectory's
        teacher logprobs (every trajectory must carry them: the trainer drops those that do not first)."""
        loss = cfg.loss
        prompts, completions, masks, behaviour = completion_tensors(batch)
        episode = row_episodes(batch)  # rows are sequences; an episode of several segments has several
        rewards = torch.tensor([t.reward for t in batch], dtype=torch.float32)
        # 1. overlong shaping: the soft penalty on the rewards (on an episode's generated tokens over all its
        # segments), truncated episodes out of the loss
        generated = [0] * len(batch)
        for row, e in enumerate(episode):
            generated[e] += sum(masks[row])
        penalties = overlong_penalties(generated, cfg.sampling.max_new_tokens, loss.overlong_buffer,
                                       loss.overlong_penalty)
        truncated = [t.rollout.finish_reason in TRUNCATED for t in batch]
        if loss.mask_truncated:
            masks = [[0] * len(m) if truncated[e] else m for m, e in zip(masks, episode, strict=True)]
        episode_tokens: list[int] = []
        if len(episode) > len(batch):
            per_episode = [0] * len(batch)
            for row, e in enumerate(episode):
                per_episode[e] += sum(masks[row])
            episode_tokens = [per_episode[e] for e in episode]
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
            behind = behind_freshest(batch)
            weights = [loss.staleness_decay ** behind[e] for e in episode]
        per_episode_advantages = advantages.tolist()
        row_advantages = [per_episode_advantages[e] for e in episode]
        tokens: list[list[float]] = []
        if distill is not None and distill.enabled:  # 3. per token: kl_coef * reverse KL + reward_weight * A_group
            if episode_tokens:  # the trainer drops such episodes first (distill.missing_teacher)
                raise ValueError("on-policy distillation does not train episodes of several segments")
            teacher = [t.teacher_logprobs or [] for t in batch]
            tokens = token_advantages(teacher, behaviour, masks, row_advantages,
                                      kl_coef=distill.kl_coef, reward_weight=distill.reward_weight)
            figures.update(distill_figures(teacher, behaviour, masks))
        return cls(prompts, completions, masks, behaviour, row_advantages, rewards.tolist(),
                   loss_total(masks, range(len(masks)), str(loss.aggregation), episode_tokens), weights, figures,
                   tokens, episode_tokens)

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


def loss_total(masks: list[list[int]], rows: Any, aggregation: str, episode_tokens: list[int] | None = None) -> float:
    """The loss normaliser of ``rows``: episodes with a loss token (the seq_mean aggregations; a row that is a
    segment of an episode counts as its share of the episode's loss tokens, ``episode_tokens``) or loss tokens."""
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        if episode_tokens:
            return float(sum(sum(masks[i]) / episode_tokens[i] for i in rows if episode_tokens[i] > 0))
        return float(sum(1 for i in rows if sum(masks[i]) > 0))
    return float(sum(sum(masks[i]) for i in rows))
