"""Episodes of several segments (a black-box agent that rewrote its history) in the trainer: each segment a
row with its own prompt and mask, the episode's reward and group advantage on every row, the loss counting
the episode once (hand-worked numbers), the staleness filter reading the oldest version over all segments,
and on the real tiny Llama: an episode cut into two segments whose second prompt is exactly the first
sequence trains exactly like the one sequence."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from proto.rollouts import EpisodeSegment, Rollout, Turn
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.trainer import devices
from services.trainer.admission import is_stale
from services.trainer.config import TrainerConfig
from services.trainer.distill import missing_teacher
from services.trainer.learner import Learner
from services.trainer.loss import grpo_loss
from services.trainer.step_input import StepInput, completion_tensors, loss_total, row_episodes


def _turn(ids: list[int], version: int = 0, role: str = "assistant") -> Turn:
    if role == "tool":
        return Turn(role="tool", token_ids=ids)
    return Turn(role="assistant", token_ids=ids, logprobs=[-1.0 - 0.1 * k for k in range(len(ids))],
                versions=[version] * len(ids))


def _trajectory(i: int, reward: float, turns: list[Turn], extra: list[EpisodeSegment] | None = None,
                prompt: list[int] | None = None) -> ScoredTrajectory:
    rollout = Rollout(run_id="r", msg_id=f"r-g-s{i}", task="t", group_id="g", prompt_id="p", sample_index=i,
                      group_size=2, prompt_ids=prompt or [1, 5, 6], turns=turns, finish_reason="eos",
                      policy_version=0, extra_segments=extra or [])
    return ScoredTrajectory(run_id="r", msg_id=f"r-g-s{i}", rollout=rollout, reward=reward)


def _two_segment_episode(version_2: int = 0) -> ScoredTrajectory:
    """Segment 1: prompt [1 5 6], generated [7 8], a user turn [3], generated [9]; segment 2 (the agent
    truncated its history): prompt [1 5 4], generated [10 11]."""
    second = EpisodeSegment(prompt_ids=[1, 5, 4], turns=[_turn([10, 11], version_2)])
    return _trajectory(0, 1.0, [_turn([7, 8]), _turn([3], role="tool"), _turn([9])], [second])


def _aggregate_cases():
    """Rows: the 2-segment episode's segments (ratios 1.1, 0.9 | 1.2; A = +1), a one-sequence episode
    (ratios 1, 1; A = -1). On the unclipped side pg(t) = -rho(t) * A."""
    rho = torch.tensor([[1.1, 0.9], [1.2, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    return rho, mask, torch.tensor([1.0, 1.0, -1.0]), torch.tensor([3.0, 3.0, 2.0])


@pytest.mark.parametrize(("aggregation", "episodes", "rows"), [
    # the episode once: ((-1.1 - 0.9)/3 + (-1.2)/3 + (1 + 1)/2) / (2/3 + 1/3 + 1) = (-3.2/3 + 1) / 2
    ("seq_mean_token_mean", (-3.2 / 3 + 1.0) / 2, (-1.0 - 1.2 + 1.0) / 3),
    # every loss token once, segmented or not: (-1.1 - 0.9 - 1.2 + 1 + 1) / 5
    ("token_mean", -1.2 / 5, -1.2 / 5),
    # token sums over norm_tokens = 4, the episode once: ((-2 - 1.2)/4 + 2/4) / 2
    ("seq_mean_token_sum_norm", (-3.2 / 4 + 0.5) / 2, (-0.5 - 0.3 + 0.5) / 3),
])
def test_the_loss_counts_an_episode_of_segments_once_hand_worked(aggregation, episodes, rows):
    rho, mask, adv, episode_tokens = _aggregate_cases()
    logprobs = torch.full_like(rho, -1.0)
    old = logprobs - torch.log(rho)  # rho = exp(logprobs - old); behaviour = old: importance weight 1
    kw = dict(old_logprobs=old, aggregation=aggregation, norm_tokens=4.0)
    loss, _ = grpo_loss(logprobs, old, adv, mask, episode_tokens=episode_tokens, **kw)
    assert float(loss) == pytest.approx(episodes, abs=1e-6)
    per_row, _ = grpo_loss(logprobs, old, adv, mask, **kw)  # segments counted as episodes (not what we do)
    assert float(per_row) == pytest.approx(rows, abs=1e-6)
    # the two segments as the one sequence they would have been: the same loss
    joined = torch.tensor([[1.1, 0.9, 1.2], [1.0, 1.0, 1.0]])
    jmask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    jl = torch.full_like(joined, -1.0)
    one, _ = grpo_loss(jl, jl - torch.log(joined), adv[1:], jmask, **{**kw, "old_logprobs": jl - torch.log(joined)})
    assert float(one) == pytest.approx(episodes, abs=1e-6)
    # micro-batches that split the episode's segments add up to the whole (each normalised by the batch's total)
    masks = mask.int().tolist()
    total = loss_total(masks, range(3), aggregation, episode_tokens.int().tolist())
    parts = [grpo_loss(logprobs[r], old[r], adv[r], mask[r], episode_tokens=episode_tokens[r], total=total,
                       **{**kw, "old_logprobs": old[r]})[0] for r in ([0], [1, 2])]
    assert float(sum(parts)) == pytest.approx(episodes, abs=1e-6)


def test_an_episode_of_segments_becomes_rows_sharing_its_reward_and_advantage():
    batch = [_two_segment_episode(), _trajectory(1, 0.0, [_turn([7, 12, 13])])]
    prompts, completions, masks, _ = completion_tensors(batch)
    assert row_episodes(batch) == [0, 0, 1]
    assert prompts == [[1, 5, 6], [1, 5, 4], [1, 5, 6]]
    assert completions == [[7, 8, 3, 9], [10, 11], [7, 12, 13]]
    assert masks == [[1, 1, 0, 1], [1, 1], [1, 1, 1]]  # prompts out, the user turn between masked
    inp = StepInput.of(batch, TrainerConfig())
    a = 1 / math.sqrt(2)  # rewards 1 and 0: centred +-0.5, sample std sqrt(0.5)
    assert inp.advantages == pytest.approx([a, a, -a], abs=1e-5)  # the group is the two episodes
    assert inp.rewards == [1.0, 0.0]  # per episode
    assert inp.episode_tokens == [5, 5, 3] and inp.total == pytest.approx(2.0)  # two episodes
    # one-sequence batches are as before: no episode_tokens, one row per trajectory
    plain = StepInput.of(batch[1:], TrainerConfig())
    assert plain.episode_tokens == [] and len(plain.completions) == 1
    # token_mean normalises by every loss token, the segments' included
    tm = StepInput.of(batch, msgspec.convert({"loss": {"aggregation": "token_mean"}}, TrainerConfig))
    assert tm.total == 8.0


def test_truncation_decay_and_staleness_read_the_whole_episode():
    episode = _two_segment_episode(version_2=3)
    cut = msgspec.structs.replace(episode.rollout, finish_reason="length", turns=[_turn([7, 8], version=5)])
    # the oldest version over every segment: the second segment's 3, though the first is at 5
    assert episode.rollout.min_version() == 0 and cut.min_version() == 3
    assert is_stale(cut.min_version(), current_version=5, max_staleness=1)
    truncated = msgspec.structs.replace(episode, rollout=cut)
    inp = StepInput.of([truncated, _trajectory(1, 0.0, [_turn([7], version=5)])],
                       msgspec.convert({"loss": {"staleness_decay": 0.5, "mask_truncated": True}},
                                       TrainerConfig))
    assert inp.masks[:2] == [[0, 0], [0, 0]]  # mask_truncated: every segment of a truncated episode
    assert inp.weights == [0.25, 0.25, 1.0]  # 2 versions behind the freshest, on each of its rows
    assert "segments" in missing_teacher(episode)  # distillation refuses them with the reason


def test_extra_segments_travel_through_the_group_messages():
    episode = _two_segment_episode()
    group = ScoredGroup.of([episode, _trajectory(1, 0.0, [_turn([7])])])
    back = group.records()
    assert back[0].rollout.extra_segments == episode.rollout.extra_segments
    assert back[1].rollout.extra_segments == []
    assert back[0].rollout.text() == "".join(t.text for t in episode.rollout.all_turns())


def test_a_split_episode_trains_like_the_one_sequence_on_the_real_model(loop_model_dir):
    """Segment 2's prompt is exactly segment 1's prompt + tokens: every token sees the context it would in one
    sequence, so the loss and every gradient equal the unsplit episode's (seq_mean_token_mean and token_mean)."""
    first, rest = [_turn([7, 8]), _turn([3], role="tool")], [_turn([9, 10, 11])]
    one = [_trajectory(0, 1.0, first + rest), _trajectory(1, 0.0, [_turn([7, 12, 13])])]
    split = [_trajectory(0, 1.0, first, [EpisodeSegment(prompt_ids=[1, 5, 6, 7, 8, 3], turns=rest)]), one[1]]
    for aggregation in ("seq_mean_token_mean", "token_mean"):
        grads, losses = [], []
        for batch in (one, split):
            cfg = msgspec.convert({"devices": {"num_threads": 1, "device": "cpu"},
                                   "loss": {"aggregation": aggregation}}, TrainerConfig)
            learner = Learner(cfg, loop_model_dir, devices.resolve(cfg))
            sums, _, _ = learner.accumulate(StepInput.of(batch, cfg))
            losses.append(sums["losses/policy"])
            grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None]))
        assert losses[1] == pytest.approx(losses[0], abs=1e-5)
        assert torch.allclose(grads[0], grads[1], atol=1e-5) and grads[0].abs().sum() > 0
