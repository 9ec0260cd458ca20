"""The GRPO loss against numbers worked out by hand (see each test's comments)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import LossInputError, group_advantages, grpo_loss

LN = math.log

# A tiny batch: two completions, three token slots; completion 1 has one padding slot.
#   completion 0: advantage +1, three tokens; completion 1: advantage -1, two tokens.
LOGPROBS = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 5.0]]  # 5.0 sits on padding: must never count
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADVANTAGES = [1.0, -1.0]
# PPO ratios pi_theta / pi_prox chosen by hand: r = 1.5, 1.1, 0.7 | 0.7, 1.5, (pad)
RATIOS = [[1.5, 1.1, 0.7], [0.7, 1.5, 1.0]]
# Importance weights pi_prox / mu: w = 1, 3, 0.5 | 1.2, 1, (pad)
WEIGHTS = [[1.0, 3.0, 0.5], [1.2, 1.0, 1.0]]


def batch():
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    old = torch.tensor(LOGPROBS) - torch.log(torch.tensor(RATIOS))
    behaviour = old - torch.log(torch.tensor(WEIGHTS))
    return logprobs, old, behaviour, torch.tensor(ADVANTAGES), torch.tensor(MASK)


# --- advantages -------------------------------------------------------------------------------


def test_group_advantages_normalised_by_sample_std():
    # group a: rewards 1, 0, 0 -> mean 1/3, centred 2/3, -1/3, -1/3;
    #   sample std = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.577350
    #   -> 0.666667 / 0.577350 = 1.154701, -0.333333 / 0.577350 = -0.577350
    # group b: 0.5, 0.5 -> all equal -> 0; group c: a single completion -> 0
    adv = group_advantages([1.0, 0.0, 0.0, 0.5, 0.5, 0.9], ["a", "a", "a", "b", "b", "c"], eps=0.0)
    expected = [1.154701, -0.577350, -0.577350, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_group_advantages_without_std():
    adv = group_advantages([1.0, 0.0, 0.0, 0.5, 0.5], [7, 7, 7, 3, 3], normalize_std=False)
    assert adv.tolist() == pytest.approx([0.666667, -0.333333, -0.333333, 0.0, 0.0], abs=1e-5)


def test_group_advantages_interleaved_groups_and_tensor_ids():
    # Same numbers as above, interleaved order, int tensor group ids.
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([1, 2, 2, 1]), eps=0.0)
    # group 1: 0, 0 -> 0, 0; group 2: 1, 0 -> mean .5, std sqrt(.5) = 0.707107 -> +-0.707107
    assert adv.tolist() == pytest.approx([0.0, 0.707107, -0.707107, 0.0], abs=1e-5)


def test_group_advantages_rejects_mismatched_lengths():
    with pytest.raises(LossInputError, match="one group id each"):
        group_advantages([1.0, 0.0], ["a"])


# --- clipping, IS weights, aggregation ------------------------------------------------------
# Clipped surrogate with clip_low=0.2, clip_high=0.28 -> clamp(r, 0.8, 1.28):
#   completion 0 (A=+1): min(r, clamp(r)) = min(1.5, 1.28)=1.28 [clipped], 1.1, min(0.7, 0.8)=0.7
#       pg = -1.28, -1.1, -0.7
#   completion 1 (A=-1): min(-0.7, -0.8) = -0.8 [clipped], min(-1.5, -1.28) = -1.5
#       pg = 0.8, 1.5
#   clip_frac = 2 clipped of 5 tokens = 0.4


def test_tis_token_mean():
    # tis, cap 2: w = 1, min(3, 2)=2, 0.5 | 1.2, 1  (one of five truncated)
    # per token: -1.28, -2.2, -0.35 | 0.96, 1.5 ; sum = -1.37 ; token mean = -1.37 / 5 = -0.274
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(
        logprobs, behaviour, adv, mask, old_logprobs=old, is_mode="tis", is_cap=2.0, aggregation="token_mean"
    )
    assert loss.item() == pytest.approx(-0.274, abs=1e-5)
    assert m["policy/clip_frac"] == pytest.approx(0.4)
    assert m["policy/is_weight_mean"] == pytest.approx((1 + 2 + 0.5 + 1.2 + 1) / 5, abs=1e-5)
    assert m["policy/is_truncated_frac"] == pytest.approx(0.2)
    # approx_kl = mean((r - 1) - ln r) = (0.094535 + 0.004690 + 0.056675 + 0.056675 + 0.094535) / 5
    assert m["policy/approx_kl"] == pytest.approx(0.061424, abs=1e-5)
    # entropy estimate = mean(-logprobs) over the five real tokens = (1 + .5 + 2 + .3 + 1.2) / 5
    assert m["policy/entropy"] == pytest.approx(1.0, abs=1e-6)


def test_tis_seq_mean_token_mean_is_the_default():
    # completion means: (-1.28 - 2.2 - 0.35) / 3 = -1.276667 ; (0.96 + 1.5) / 2 = 1.23
    # mean over completions = (-1.276667 + 1.23) / 2 = -0.023333
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, is_cap=2.0)
    assert loss.item() == pytest.approx(-0.0233333, abs=1e-5)
    assert m["losses/policy"] == pytest.approx(-0.0233333, abs=1e-5)


def test_decoupled_drops_tokens_over_the_cap():
    # decoupled, cap 2: w = 1, 0 (3 > 2: dropped), 0.5 | 1.2, 1
    # per token: -1.28, 0, -0.35 | 0.96, 1.5 ; means -0.543333, 1.23 ; loss = 0.343333
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, is_mode="decoupled", is_cap=2.0)
    assert loss.item() == pytest.approx(0.3433333, abs=1e-5)
    assert m["policy/is_weight_mean"] == pytest.approx(3.7 / 5, abs=1e-5)
    assert m["policy/is_truncated_frac"] == pytest.approx(0.2)
    # token_mean: (-1.63 + 2.46) / 5 = 0.166
    loss, _ = grpo_loss(
        logprobs,
        behaviour,
        adv,
        mask,
        old_logprobs=old,
        is_mode="decoupled",
        is_cap=2.0,
        aggregation="token_mean",
    )
    assert loss.item() == pytest.approx(0.166, abs=1e-5)


def test_no_is_correction():
    # none: w = 1 ; means (-1.28 - 1.1 - 0.7) / 3 = -1.026667, (0.8 + 1.5) / 2 = 1.15 ; loss = 0.0616667
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, is_mode="none")
    assert loss.item() == pytest.approx(0.0616667, abs=1e-5)
    assert m["policy/is_weight_mean"] == pytest.approx(1.0)
    assert m["policy/is_truncated_frac"] == 0.0


def test_none_mode_takes_the_ratio_against_the_behaviour_policy():
    # Without old_logprobs, classic PPO: r = pi_theta / mu = RATIOS * WEIGHTS
    #   = 1.5, 3.3, 0.35 | 0.84, 1.5 -> clamp to [0.8, 1.28]
    #   A=+1: min(1.5, 1.28)=1.28, min(3.3, 1.28)=1.28, min(.35, .8)=.35 -> pg -1.28, -1.28, -0.35
    #   A=-1: min(-.84, -.84)=-.84, min(-1.5, -1.28)=-1.5 -> pg .84, 1.5
    #   token mean = (-2.91 + 2.34) / 5 = -0.114
    logprobs, _, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, is_mode="none", aggregation="token_mean")
    assert loss.item() == pytest.approx(-0.114, abs=1e-5)
    assert m["policy/clip_frac"] == pytest.approx(0.4)


def test_symmetric_clip_when_clip_high_equals_clip_low():
    # clip_high = 0.2 -> clamp(r, 0.8, 1.2): completion 0 token 0 becomes min(1.5, 1.2) = 1.2
    # tis: -1.2, -2.2, -0.35 | 0.96, 1.5 -> token mean = (-3.75 + 2.46) / 5 = -0.258
    logprobs, old, behaviour, adv, mask = batch()
    loss, _ = grpo_loss(
        logprobs,
        behaviour,
        adv,
        mask,
        old_logprobs=old,
        clip_low=0.2,
        clip_high=0.2,
        is_cap=2.0,
        aggregation="token_mean",
    )
    assert loss.item() == pytest.approx(-0.258, abs=1e-5)


def test_k3_kl_penalty():
    # d = log pi_ref - log pi_theta = 0, ln 2, -ln 2 | ln 2, 0
    # k3 = e^d - d - 1 = 0, 0.306853, 0.193147 | 0.306853, 0
    # per-completion means 0.5 / 3 = 0.166667, 0.153426 ; kl = 0.160047
    logprobs, old, behaviour, adv, mask = batch()
    d = torch.tensor([[0.0, LN(2), -LN(2)], [LN(2), 0.0, 0.0]])
    ref = torch.tensor(LOGPROBS) + d
    loss, m = grpo_loss(
        logprobs, behaviour, adv, mask, old_logprobs=old, ref_logprobs=ref, kl_coef=0.1, is_cap=2.0
    )
    assert m["losses/kl"] == pytest.approx(0.1600466, abs=1e-5)
    assert loss.item() == pytest.approx(-0.0233333 + 0.1 * 0.1600466, abs=1e-5)


def test_kl_coef_without_reference_is_an_error():
    logprobs, old, behaviour, adv, mask = batch()
    with pytest.raises(LossInputError, match="ref_logprobs"):
        grpo_loss(logprobs, behaviour, adv, mask, kl_coef=0.1)


def test_sample_weights_scale_the_policy_term_only():
    # tis per token: -1.28, -2.2, -0.35 | 0.96, 1.5 ; completion means -1.276667, 1.23
    # s = 0.5, 1 -> -0.638333, 1.23 ; policy = (-0.638333 + 1.23) / 2 = 0.295833
    # the KL term is not weighted: + 0.1 * 0.1600466 (see test_k3_kl_penalty)
    logprobs, old, behaviour, adv, mask = batch()
    ref = torch.tensor(LOGPROBS) + torch.tensor([[0.0, LN(2), -LN(2)], [LN(2), 0.0, 0.0]])
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, ref_logprobs=ref, kl_coef=0.1,
                        sample_weights=torch.tensor([0.5, 1.0]), is_cap=2.0)
    assert m["losses/policy"] == pytest.approx(0.2958333, abs=1e-5)
    assert loss.item() == pytest.approx(0.2958333 + 0.1 * 0.1600466, abs=1e-5)
    with pytest.raises(LossInputError, match="sample_weights"):
        grpo_loss(logprobs, behaviour, adv, mask, sample_weights=torch.tensor([1.0]))


def test_decoupled_ppo_second_update_clips_against_the_proximal_policy():
    # Decoupled PPO over two updates of one batch. Proximal policy = the weights before the first
    # update; behaviour mu is one version older. One token, A = +1, clip [0.8, 1.28], tis cap 2:
    #   log mu = ln 0.2, log pi_prox = ln 0.3 -> w = 0.3 / 0.2 = 1.5 (behaviour correction)
    #   update 1: pi_theta = pi_prox = 0.3 -> r = 1, pg = -1.5 * 1 = -1.5, gradient -1.5 (unclipped)
    #   update 2: pi_theta = 0.42 -> r = 1.4 > 1.28: clipped, pg = -1.5 * 1.28 = -1.92, gradient 0
    # (without old_logprobs the second update would take r = 1 again and push on: gradient -1.5)
    behaviour = torch.tensor([[LN(0.2)]])
    prox = torch.tensor([[LN(0.3)]])
    adv, mask = torch.tensor([1.0]), torch.tensor([[1.0]])
    for theta, loss_ref, grad_ref, clip_frac in ((0.3, -1.5, -1.5, 0.0), (0.42, -1.92, 0.0, 1.0)):
        logprobs = torch.tensor([[LN(theta)]], requires_grad=True)
        loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=prox, is_mode="tis", is_cap=2.0)
        loss.backward()
        assert loss.item() == pytest.approx(loss_ref, abs=1e-5)
        assert logprobs.grad.item() == pytest.approx(grad_ref, abs=1e-5)
        assert m["policy/clip_frac"] == clip_frac
        assert m["policy/is_weight_mean"] == pytest.approx(1.5, abs=1e-5)
    logprobs = torch.tensor([[LN(0.42)]], requires_grad=True)
    grpo_loss(logprobs, behaviour, adv, mask, is_mode="tis", is_cap=2.0)[0].backward()
    assert logprobs.grad.item() == pytest.approx(-2.0, abs=1e-5)  # w = min(0.42 / 0.2, 2) = 2, r = 1


# --- gradients -------------------------------------------------------------------------------


def test_gradient_of_the_clipped_surrogate():
    # token mean, tis: d/d logprob of -w * A * r / N where the unclipped branch is active, 0 where the
    # clipped (constant) branch is:
    #   completion 0: clipped -> 0 ; -2 * 1 * 1.1 / 5 = -0.44 ; -0.5 * 1 * 0.7 / 5 = -0.07
    #   completion 1: clipped -> 0 ; -1 * (-1) * 1.5 / 5 = 0.3 ; padding -> 0
    logprobs, old, behaviour, adv, mask = batch()
    loss, _ = grpo_loss(
        logprobs, behaviour, adv, mask, old_logprobs=old, is_cap=2.0, aggregation="token_mean"
    )
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.44, -0.07], [0.0, 0.3, 0.0]]), atol=1e-5)


def test_on_policy_gradient_is_the_reinforce_gradient():
    # old_logprobs defaults to the current policy (detached) and mu = pi_theta: r = 1, w = 1, so the
    # gradient is -A_i / (len_i * B) per token: -1/6 on completion 0, +1/4 on completion 1's tokens.
    logprobs, _, _, adv, mask = batch()
    loss, m = grpo_loss(logprobs, logprobs.detach(), adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # -(1 * 1 + (-1) * 1) / 2
    assert m["policy/clip_frac"] == 0.0
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 6] * 3, [0.25, 0.25, 0.0]]), atol=1e-6)


def test_micro_batches_with_total_add_up_to_the_full_batch():
    logprobs, old, behaviour, adv, mask = batch()
    for aggregation, total in (("token_mean", 5.0), ("seq_mean_token_mean", 2.0)):
        full, _ = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, aggregation=aggregation)
        parts = [
            grpo_loss(
                logprobs[i : i + 1],
                behaviour[i : i + 1],
                adv[i : i + 1],
                mask[i : i + 1],
                old_logprobs=old[i : i + 1],
                aggregation=aggregation,
                total=total,
            )[0]
            for i in range(2)
        ]
        assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_a_completion_without_loss_tokens_does_not_count():
    # completion 1 fully masked: the seq mean is completion 0's mean alone (tis): -1.276667
    logprobs, old, behaviour, adv, _ = batch()
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, _ = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, is_cap=2.0)
    assert loss.item() == pytest.approx(-1.276667, abs=1e-5)


def test_shape_mismatch_is_an_error():
    logprobs, old, behaviour, adv, mask = batch()
    with pytest.raises(LossInputError, match="behaviour_logprobs"):
        grpo_loss(logprobs, behaviour[:, :2], adv, mask)
    with pytest.raises(LossInputError, match="is_mode"):
        grpo_loss(logprobs, behaviour, adv, mask, is_mode="bogus")  # type: ignore[arg-type]
