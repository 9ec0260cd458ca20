"""GSPO, CISPO, Dr. GRPO, IcePop and the mismatch masks (MIS) against numbers worked out by hand, on the batch
of test_loss.py; the overlong penalty; and the option combinations that stop start-up, naming the keys."""

from __future__ import annotations

import math

import pytest
import torch
from test_loss import WEIGHTS, batch

from services.launcher import registry
from services.runtime.config import ConfigError, load_service_config
from services.trainer.loss import LossInputError, grpo_loss
from services.trainer.step_input import overlong_penalties

# The batch (test_loss.py): completion 0 (A = +1) has token ratios rho = 1.5, 1.1, 0.7 and importance weights
# pi_prox / mu = 1, 3, 0.5; completion 1 (A = -1) has rho = 0.7, 1.5 and weights 1.2, 1; one padding slot.


def _grad(loss: torch.Tensor, logprobs: torch.Tensor) -> list[list[float]]:
    loss.backward()
    assert logprobs.grad is not None
    return logprobs.grad.tolist()


# --- GSPO -------------------------------------------------------------------------------------
# s_0 = (1.5 * 1.1 * 0.7) ** (1/3) = 1.155 ** (1/3) = 1.049206;  s_1 = (0.7 * 1.5) ** (1/2) = 1.05 ** .5 = 1.024695
# sequence IS weights (tis, cap 2): w_0 = (1 * 3 * 0.5) ** (1/3) = 1.144714;  w_1 = 1.2 ** .5 = 1.095445


def test_gspo_takes_one_clipped_ratio_per_completion():
    # clip [0.8, 1.28]: neither clipped. pg_0 = -1.049206 * 1 ; pg_1 = -min(-1.024695, -1.024695) = 1.024695
    # completion losses: -1.049206 * 1.144714 = -1.201041 ; 1.024695 * 1.095445 = 1.122497
    # seq_mean_token_mean: (-1.201041 + 1.122497) / 2 = -0.039272
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, loss_type="gspo", is_cap=2.0)
    assert loss.item() == pytest.approx(-0.039272, abs=1e-5)
    assert m["policy/clip_frac"] == 0.0
    # d loss / d log pi(t) = 1/2 * (-A_i w_i s_i / n_i): the sequence ratio's gradient is spread over its tokens
    g0, g1 = -1.144714 * 1.049206 / 3 / 2, 1.095445 * 1.024695 / 2 / 2  # -0.200173, 0.280624
    assert _grad(loss, logprobs) == [pytest.approx([g0, g0, g0], abs=1e-5), pytest.approx([g1, g1, 0.0], abs=1e-5)]


def test_gspo_clips_the_whole_completion():
    # clip_high 0.04: s_0 = 1.049206 > 1.04 with A > 0 -> pg_0 = -1.04, no gradient on any of its 3 tokens;
    # completion 1 unchanged. (-1.04 * 1.144714 + 1.122497) / 2 = (-1.190503 + 1.122497) / 2 = -0.034003
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, loss_type="gspo", clip_high=0.04)
    assert loss.item() == pytest.approx(-0.034003, abs=1e-5)
    assert m["policy/clip_frac"] == pytest.approx(3 / 5)
    g1 = 1.095445 * 1.024695 / 2 / 2
    assert _grad(loss, logprobs) == [pytest.approx([0.0] * 3, abs=1e-7), pytest.approx([g1, g1, 0.0], abs=1e-5)]


def test_gspo_refuses_token_level_aggregation():
    logprobs, old, behaviour, adv, mask = batch()
    with pytest.raises(LossInputError, match="'gspo' takes one ratio per completion.*'seq_mean_token_mean'"):
        grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, loss_type="gspo", aggregation="token_mean")


# --- CISPO ------------------------------------------------------------------------------------


def test_cispo_weighs_a_reinforce_term_by_the_clipped_detached_ratio():
    # clip(rho, 0.8, 1.28) = 1.28, 1.1, 0.8 | 0.8, 1.28 ; tis weights 1, 2, 0.5 | 1.2, 1
    # pg(t) = -clip * A * w * log pi:  completion 0 (log pi -1, -.5, -2): 1.28, 1.1, 0.8 -> mean 1.06
    #   completion 1 (A = -1, log pi -.3, -1.2): 0.8*1.2*-.3 = -0.288, 1.28*-1.2 = -1.536 -> mean -0.912
    #   (1.06 - 0.912) / 2 = 0.074
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, loss_type="cispo", is_cap=2.0)
    assert loss.item() == pytest.approx(0.074, abs=1e-5)
    assert m["policy/clip_frac"] == pytest.approx(4 / 5)  # 1.1 is the only ratio inside the clip range
    # every token keeps a gradient, clipped ones included: 1/2 * 1/n_i * (-clip * A * w)
    expected = [[-1.28 / 6, -2.2 / 6, -0.4 / 6], [0.96 / 4, 1.28 / 4, 0.0]]
    assert _grad(loss, logprobs) == [pytest.approx(row, abs=1e-6) for row in expected]


# --- Dr. GRPO's constant normaliser -------------------------------------------------------------


def test_dr_grpo_divides_each_completion_sum_by_a_constant():
    # the tis per-token losses of test_loss.py: -1.28, -2.2, -0.35 | 0.96, 1.5 ; sums -3.83 | 2.46
    # norm_tokens 4: (-3.83 / 4 + 2.46 / 4) / 2 = (-0.9575 + 0.615) / 2 = -0.17125
    logprobs, old, behaviour, adv, mask = batch()
    loss, _ = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, loss_type="dr_grpo",
                        aggregation="seq_mean_token_sum_norm", norm_tokens=4)
    assert loss.item() == pytest.approx(-0.17125, abs=1e-5)
    # the gradient no longer depends on a completion's length: 1/2 * 1/4 * (-rho A w) where unclipped
    # (the first token of each completion is clipped: no gradient)
    assert _grad(loss, logprobs) == [pytest.approx([0.0, -1.1 * 2 / 8, -0.7 * 0.5 / 8], abs=1e-6),
                                     pytest.approx([0.0, 1.5 / 8, 0.0], abs=1e-6)]
    with pytest.raises(LossInputError, match="needs norm_tokens > 0"):
        grpo_loss(*batch()[:1], behaviour, adv, mask, aggregation="seq_mean_token_sum_norm")


# --- IcePop and the mismatch masks ---------------------------------------------------------------
# PPO terms (clip [0.8, 1.28]): -1.28, -1.1, -0.7 | 0.8, 1.5 ; weights pi/mu: 1, 3, 0.5 | 1.2, 1


def test_icepop_drops_tokens_outside_the_two_sided_band():
    # [0.8, 2]: 3 and 0.5 dropped -> -1.28, 0, 0 | 0.96, 1.5 ; token mean 1.18 / 5 = 0.236
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, is_mode="icepop", is_floor=0.8,
                        is_cap=2.0, aggregation="token_mean")
    assert loss.item() == pytest.approx(0.236, abs=1e-5)
    assert m["mismatch/masked_frac"] == pytest.approx(2 / 5)


def test_the_token_mask_rejects_tokens_and_keeps_tis_elsewhere():
    # [0.4, 2.5]: only the 3 is rejected; tis (cap 2) elsewhere -> -1.28, 0, -0.35 | 0.96, 1.5 ; 0.83 / 5 = 0.166
    logprobs, old, behaviour, adv, mask = batch()
    loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, mismatch_mask="token", mismatch_low=0.4,
                        mismatch_high=2.5, aggregation="token_mean")
    assert loss.item() == pytest.approx(0.166, abs=1e-5)
    assert m["mismatch/masked_frac"] == pytest.approx(1 / 5)


def test_sequence_masks_use_the_product_or_the_geometric_mean():
    # products 1.5 | 1.2 ; geometric means 1.144714 | 1.095445. With [0.5, 1.1]:
    #   "sequence" rejects both completions -> 0; "geometric" rejects completion 0 only ->
    #   (0 + mean(0.96, 1.5)) / 2 = 0.615
    for kind, expected, masked in (("sequence", 0.0, 1.0), ("geometric", 0.615, 3 / 5)):
        logprobs, old, behaviour, adv, mask = batch()
        loss, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old, mismatch_mask=kind,
                            mismatch_low=0.5, mismatch_high=1.1)
        assert loss.item() == pytest.approx(expected, abs=1e-5), kind
        assert m["mismatch/masked_frac"] == pytest.approx(masked), kind


def test_mismatch_figures():
    # k3 = r - 1 - ln r over 1, 3, 0.5, 1.2, 1: 0 + 0.901388 + 0.193147 + 0.017678 + 0 = 1.112213 -> / 5 = 0.222443
    # quantiles (linear) of 0.5, 1, 1, 1.2, 3: p05 at 0.2 -> 0.6 ; p50 = 1 ; p95 at 3.8 -> 1.2 + 0.8 * 1.8 = 2.64
    logprobs, old, behaviour, adv, mask = batch()
    _, m = grpo_loss(logprobs, behaviour, adv, mask, old_logprobs=old)
    assert sum(r - 1 - math.log(r) for r in WEIGHTS[0] + WEIGHTS[1][:2]) / 5 == pytest.approx(0.222443, abs=1e-6)
    assert m["mismatch/kl"] == pytest.approx(0.222443, abs=1e-5)
    assert (m["mismatch/ratio_p05"], m["mismatch/ratio_p50"], m["mismatch/ratio_p95"]) == (
        pytest.approx(0.6, abs=1e-5), pytest.approx(1.0, abs=1e-5), pytest.approx(2.64, abs=1e-5))
    assert m["mismatch/masked_frac"] == 0.0


# --- overlong shaping ---------------------------------------------------------------------------


def test_the_soft_overlong_penalty_is_linear_over_the_buffer():
    # limit 10, buffer 4: 0 up to 6 tokens, then -1/4 per token, -1 at 10 and beyond (penalty 1)
    assert overlong_penalties([3, 6, 7, 8, 10, 12], 10, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalties([9], 10, 4, 0.5) == [-0.375]
    assert overlong_penalties([12], 10, 0, 1.0) == [0.0]  # buffer 0: off


# --- combinations that stop start-up ----------------------------------------------------------


def _loaded(tmp_path, loss: str, extra: str = ""):
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\nid = "algo"\ndir = "{tmp_path / "run"}"\n[services.trainer.loss]\n{loss}\n{extra}\n')
    return load_service_config("trainer", registry.load("trainer")[0], path)


@pytest.mark.parametrize(("loss", "extra", "message"), [
    ('type = "gspo"\naggregation = "token_mean"', "",
     r"services\.trainer\.loss\.aggregation is 'token_mean' but type is \"gspo\""),
    ('type = "dr_grpo"\nnormalize_std = true', "", r"services\.trainer\.loss\.normalize_std is true but type is "),
    ('type = "dr_grpo"\naggregation = "seq_mean_token_mean"', "[services.trainer.sampling]\nmax_new_tokens = 8",
     r"services\.trainer\.loss\.aggregation is 'seq_mean_token_mean' but type is \"dr_grpo\""),
    ('type = "dr_grpo"', "", r"set services\.trainer\.loss\.norm_tokens or services\.trainer\.sampling\.max_new_tok"),
    ("overlong_buffer = 4", "", r"services\.trainer\.loss\.overlong_buffer needs .*sampling\.max_new_tokens"),
    ("overlong_buffer = 9", "[services.trainer.sampling]\nmax_new_tokens = 8",
     r"overlong_buffer \(9\) is more than services\.trainer\.sampling\.max_new_tokens \(8\)"),
    ('is_mode = "icepop"\nis_floor = 3.0', "", r"services\.trainer\.loss\.is_floor \(3\.0\) must be below"),
    ("[services.trainer.loss.mismatch]\nmask = \"token\"\nlow = 2.0\nhigh = 1.5", "",
     r"services\.trainer\.loss\.mismatch\.low \(2\.0\) and \.high \(1\.5\)"),
])
def test_option_combinations_that_make_no_sense_stop_start_up_naming_the_keys(tmp_path, loss, extra, message):
    with pytest.raises(ConfigError, match=message):
        _loaded(tmp_path, loss, extra)


def test_a_loss_type_fills_in_its_own_defaults(tmp_path):
    cfg = _loaded(tmp_path, 'type = "dr_grpo"', "[services.trainer.sampling]\nmax_new_tokens = 8").service.loss
    assert (cfg.normalize_std, cfg.aggregation, cfg.norm_tokens) == (False, "seq_mean_token_sum_norm", 8)
    default = _loaded(tmp_path, "").service.loss
    assert (default.type, default.normalize_std, default.aggregation) == ("grpo", True, "seq_mean_token_mean")
