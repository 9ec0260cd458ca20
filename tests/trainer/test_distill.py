"""On-policy distillation's per-token advantages (services/trainer/distill.py) against hand-worked numbers, and
the loss taking per-token advantages [B, T] (services/trainer/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.distill import (
    DistillInputError,
    distill_figures,
    pad_token_advantages,
    token_advantages,
)
from services.trainer.loss import LossInputError, grpo_loss

TEACHER = [[-0.5, -1.0, -2.0], [-0.1]]
BEHAVIOUR = [[-1.0, -1.0, -0.5], [-2.3]]
MASKS = [[1, 1, 0], [1]]
GROUP = [0.8, -1.0]


def test_negative_reverse_kl_mixed_with_the_group_advantage():
    # A_t = kl_coef * (teacher - behaviour) + reward_weight * A_group, 0 off the mask
    adv = token_advantages(TEACHER, BEHAVIOUR, MASKS, GROUP, kl_coef=1.0, reward_weight=0.5)
    assert adv[0] == pytest.approx([0.5 + 0.4, 0.0 + 0.4, 0.0])
    assert adv[1] == pytest.approx([2.2 - 0.5])
    # pure distillation: the reward is not read
    assert token_advantages(TEACHER, BEHAVIOUR, MASKS, GROUP, kl_coef=2.0)[0] == pytest.approx([1.0, 0.0, 0.0])
    # kl_coef 0: the group advantage on every loss token (plain GRPO)
    assert token_advantages(TEACHER, BEHAVIOUR, MASKS, GROUP, kl_coef=0.0, reward_weight=1.0)[0] == \
        pytest.approx([0.8, 0.8, 0.0])


def test_the_distance_to_the_teacher_is_reported_over_loss_tokens_only():
    # loss tokens: (-0.5, -1.0), (-1.0, -1.0), (-0.1, -2.3) as (teacher, behaviour); the masked -2.0/-0.5 is not read
    f = distill_figures(TEACHER, BEHAVIOUR, MASKS)
    assert f["distill/reverse_kl"] == pytest.approx(((-1.0 + 0.5) + 0.0 + (-2.3 + 0.1)) / 3)
    assert f["distill/teacher_logprob"] == pytest.approx((-0.5 - 1.0 - 0.1) / 3)
    assert distill_figures([[-1.0]], [[-1.0]], [[0]]) == {}  # no loss token: no figure, not a made-up 0


def test_teacher_logprobs_that_do_not_fit_the_sample_are_refused():
    with pytest.raises(DistillInputError, match="completion 0: 2 teacher logprobs for 3 tokens"):
        token_advantages([[-1.0, -1.0], [-0.1]], BEHAVIOUR, MASKS, GROUP)
    with pytest.raises(DistillInputError, match="completion 1: a teacher logprob of a loss token is not finite"):
        token_advantages([TEACHER[0], [math.nan]], BEHAVIOUR, MASKS, GROUP)
    with pytest.raises(DistillInputError, match="expected one each"):
        token_advantages(TEACHER[:1], BEHAVIOUR, MASKS, GROUP)
    # a non-finite value off the mask (a tool token) is never read
    assert token_advantages([[-0.5, -1.0, -math.inf], [-0.1]], BEHAVIOUR, MASKS, GROUP)[0][2] == 0.0


def test_the_loss_takes_per_token_advantages():
    adv = pad_token_advantages(token_advantages(TEACHER, BEHAVIOUR, MASKS, GROUP, kl_coef=1.0, reward_weight=0.5), 3)
    assert torch.allclose(adv, torch.tensor([[0.9, 0.4, 0.0], [1.7, 0.0, 0.0]]))
    behaviour = torch.tensor([[-1.0, -1.0, -0.5], [-2.3, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logprobs = behaviour.clone().requires_grad_(True)  # on-policy: ratio 1, no clipping, w = 1
    loss, metrics = grpo_loss(logprobs, behaviour, adv, mask, is_mode="none")
    # pg(t) = -A_t; per completion mean over its loss tokens, then mean over completions
    assert float(loss.detach()) == pytest.approx((-(0.9 + 0.4) / 2 - 1.7) / 2)
    loss.backward()
    # d loss / d log pi(t) = -A_t / (tokens of its completion * completions)
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.9 / 4, -0.4 / 4, 0.0], [-1.7 / 2, 0.0, 0.0]]))
    assert metrics["policy/advantage_abs_mean"] == pytest.approx((0.9 + 0.4 + 1.7) / 3)


def test_per_sequence_advantages_are_per_token_ones_repeated():
    behaviour = torch.tensor([[-1.0, -0.7], [-0.3, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logprobs = behaviour + torch.tensor([[0.1, -0.2], [0.3, 0.0]])
    a = torch.tensor([0.5, -1.5])
    seq, _ = grpo_loss(logprobs, behaviour, a, mask)
    tok, _ = grpo_loss(logprobs, behaviour, a.unsqueeze(1).expand(2, 2), mask)
    assert float(tok) == pytest.approx(float(seq))
    with pytest.raises(LossInputError, match=r"advantages \[B\] or \[B, T\]"):
        grpo_loss(logprobs, behaviour, torch.zeros(2, 3), mask)


def _trajectory(group: str, index: int, reward: float, tokens: list[int], logprobs: list[float],
                teacher: list[float] | None, observation: list[int] | None = None):
    from proto.rollouts import Rollout, Turn
    from proto.trajectories import ScoredTrajectory

    turns = [Turn(role="assistant", token_ids=tokens, logprobs=logprobs, versions=[0] * len(tokens), text="x")]
    if observation:
        turns.append(Turn(role="tool", token_ids=observation, text="obs"))
    rollout = Rollout(run_id="r", task="addition", group_id=group, prompt_id="p", sample_index=index, group_size=2,
                      prompt_ids=[1, 2], turns=turns, finish_reason="eos", policy_version=0)
    return ScoredTrajectory(run_id="r", rollout=rollout, reward=reward, teacher_logprobs=teacher)


def test_the_step_input_of_a_distillation_batch():
    from services.runtime.config import DistillSection
    from services.trainer.config import TrainerConfig
    from services.trainer.step_input import StepInput

    batch = [_trajectory("g", 0, 1.0, [5, 6], [-1.0, -2.0], [-0.5, -2.5, -9.0], observation=[7]),
             _trajectory("g", 1, 0.0, [8], [-0.2], [-1.2])]
    cfg = TrainerConfig()
    plain = StepInput.of(batch, cfg)
    assert plain.token_advantages == [] and plain.advantages == pytest.approx([0.7071, -0.7071], abs=1e-3)
    inp = StepInput.of(batch, cfg, DistillSection(enabled=True, kl_coef=1.0, reward_weight=0.5))
    a = 0.5 * plain.advantages[0]
    # (teacher - behaviour) on the assistant's tokens, 0 on the observation token, plus half the group advantage
    assert inp.token_advantages[0] == pytest.approx([0.5 + a, -0.5 + a, 0.0])
    assert inp.token_advantages[1] == pytest.approx([-1.0 - a])
    # the step reports the distance: behaviour - teacher over the three loss tokens (-0.5, 0.5, 1.0)
    assert inp.figures["distill/reverse_kl"] == pytest.approx(1.0 / 3)
    assert "distill/reverse_kl" not in plain.figures
    assert StepInput.of(batch, cfg, DistillSection(enabled=False)).token_advantages == []


def test_a_trajectory_without_fitting_teacher_logprobs_is_named():
    from services.trainer.distill import missing_teacher

    assert missing_teacher(_trajectory("g", 0, 1.0, [5, 6], [-1.0, -2.0], [-0.5, -2.5])) == ""
    assert missing_teacher(_trajectory("g", 0, 1.0, [5, 6], [-1.0, -2.0], None)).startswith("no teacher logprobs")
    assert missing_teacher(_trajectory("g", 0, 1.0, [5, 6], [-1.0, -2.0], [-0.5])) == \
        "teacher logprobs do not fit: 1 for 2 tokens"


def _distill_runfile(tmp_path, extra: str):
    from services.launcher.runfile import RunFile

    path = tmp_path / "run.toml"
    path.write_text('[launcher]\nservices = { trainer = 1, rollout = 1, judge = 1, weightsync = 1, teacher = 1 }\n'
                    '[model]\nname = "tiny-addition"\n[task]\nname = "addition"\n[distill]\nenabled = true\n'
                    f'reward_weight = 0.0\n[services.teacher]\nmodel = "tiny-addition"\n{extra}')
    return RunFile.load(path, env={})


def test_distillation_refuses_what_does_not_go_with_it(tmp_path):
    import pytest

    from services.runtime.config import ConfigError

    _distill_runfile(tmp_path, "").check()  # the base file is fine
    with pytest.raises(ConfigError, match="distill.enabled and services.trainer.loss.type"):
        _distill_runfile(tmp_path, '[services.trainer.loss]\ntype = "gspo"\n').check()
    with pytest.raises(ConfigError, match="dynamic_sampling and distill.reward_weight"):
        _distill_runfile(tmp_path, "[services.trainer]\ndynamic_sampling = true\n").check()
    no_teacher = _distill_runfile(tmp_path, "")
    no_teacher.launcher.services.pop("teacher")
    with pytest.raises(ConfigError, match="needs a teacher service"):
        no_teacher.check()
