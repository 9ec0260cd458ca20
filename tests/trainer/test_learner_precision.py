"""The learner's precision and memory switches on a real tiny Llama (CPU): token-budget micro-batches,
gradient checkpointing and bf16 mixed precision change how a step computes, not what it computes."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.trainer import devices
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner, StepInput
from tests.distributed.rank_script import batch


def _learner(model_dir, dtype: str = "float32", **groups) -> Learner:
    """A CPU learner; ``groups``: the config's groups (``optim={...}``), ``dtype`` the run's ``[model] dtype``."""
    placement = {"num_threads": 1, "device": "cpu", **groups.pop("devices", {})}
    cfg = msgspec.convert({"devices": placement, **groups}, TrainerConfig)
    return Learner(cfg, model_dir, devices.resolve(cfg, dtype=dtype))


def _grads(learner: Learner, seed: int = 7) -> tuple[dict[str, torch.Tensor], int]:
    inp = StepInput.of(batch(seed, groups=4), learner.cfg)
    _, n_mb, _ = learner.accumulate(inp)
    return {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}, n_mb


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> float:
    """Largest gradient difference relative to the largest gradient entry (asserts the same keys)."""
    assert a.keys() == b.keys() and a
    scale = max(v.abs().max().item() for v in a.values())
    worst = max((a[k] - b[k]).abs().max().item() for k in a) / scale
    assert worst <= rtol, f"gradients differ by {worst:.2e} of their scale (allowed {rtol:.0e})"
    return worst


def test_token_budget_micro_batches_give_the_gradient_of_one_big_batch(loop_model_dir):
    whole, n_whole = _grads(_learner(loop_model_dir, optim={"micro_batch_size": 64}))
    budget, n_budget = _grads(_learner(loop_model_dir, optim={"micro_batch_size": 64, "max_tokens_per_micro_batch": 40}))
    assert n_whole == 1 and n_budget >= 4  # the budget really cut the batch
    _close(whole, budget, 1e-5)


@pytest.mark.parametrize("groups", [{}, {"loss": {"kl_coef": 0.1}}, {"optim": {"minibatches": 2}}])
def test_packed_sequences_give_the_padded_gradient(loop_model_dir, groups):
    """optim.packing (the default) against right-padded rows: the same gradient, with a KL reference and with
    proximal logprobs (two minibatches) too."""
    from services.lib.model_io import sequence_logprobs
    from services.lib.packing import packed_sequence_logprobs

    optim = {"micro_batch_size": 64, **groups.get("optim", {})}
    rest = {k: v for k, v in groups.items() if k != "optim"}
    padded = _learner(loop_model_dir, optim={**optim, "packing": False}, **rest)
    packed = _learner(loop_model_dir, optim=optim, **rest)
    assert padded.logprobs is sequence_logprobs and packed.logprobs is packed_sequence_logprobs
    if "minibatches" in optim:  # a whole step: proximal logprobs, two updates; the same weights after it
        inp = StepInput.of(batch(7, groups=4), padded.cfg)
        a, b = padded.step_input(inp), packed.step_input(inp)
        assert a["optim/updates"] == b["optim/updates"] == 2.0
        assert a["losses/total"] == pytest.approx(b["losses/total"], rel=1e-4, abs=1e-6)
        after = packed.model.state_dict()
        assert all(torch.allclose(v, after[k], atol=1e-5) for k, v in padded.model.state_dict().items())
        return
    _close(_grads(padded)[0], _grads(packed)[0], 1e-5)


def test_gradient_checkpointing_gives_the_same_gradient(loop_model_dir):
    plain, _ = _grads(_learner(loop_model_dir, optim={"micro_batch_size": 5}))
    recomputed = _learner(loop_model_dir, optim={"micro_batch_size": 5, "gradient_checkpointing": True})
    assert recomputed.model.is_activation_checkpointing
    _close(plain, _grads(recomputed)[0], 1e-5)


def test_bf16_mixed_precision_keeps_fp32_master_weights_and_sends_bf16(loop_model_dir):
    fp32, _ = _grads(_learner(loop_model_dir))
    mixed = _learner(loop_model_dir, dtype="bfloat16")
    grads, _ = _grads(mixed)
    # bf16 compute: close to the float32 gradient, but not bit-equal (so bf16 really ran)
    worst = _close(fp32, grads, 0.1)
    assert worst > 1e-6
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())  # master weights
    metrics = mixed.step_input(StepInput.of(batch(8, groups=4), mixed.cfg))
    assert metrics["optim/skipped"] == 0.0 and torch.isfinite(torch.tensor(metrics["losses/total"]))
    state = next(iter(mixed.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32  # AdamW's moments in float32
    sent = mixed.state_dict()
    assert {v.dtype for v in sent.values() if v.is_floating_point()} == {torch.bfloat16}


@pytest.mark.parametrize("ref_device", ["", "cpu"])
def test_the_reference_model_lives_on_its_own_device(loop_model_dir, ref_device):
    learner = _learner(loop_model_dir, loss={"kl_coef": 0.1}, devices={"ref_device": ref_device})
    assert learner.ref_model is not None
    assert next(learner.ref_model.parameters()).device == torch.device(learner.placement.ref_device)
    assert not any(p.requires_grad for p in learner.ref_model.parameters())
    metrics = learner.step_input(StepInput.of(batch(9), learner.cfg))
    assert metrics["losses/kl"] >= 0.0 and metrics["optim/skipped"] == 0.0


def test_the_reference_model_is_the_initial_policy_when_the_policy_comes_from_a_checkpoint(loop_model_dir, tmp_path):
    from services.lib.model_io import save_policy

    trained = _learner(loop_model_dir)
    trained.step_input(StepInput.of(batch(3), trained.cfg))  # weights that differ from the initial policy
    ckpt = save_policy(trained.model, trained.tokenizer, tmp_path / "ckpt")
    cfg = msgspec.convert({"devices": {"num_threads": 1, "device": "cpu"}, "loss": {"kl_coef": 0.1}}, TrainerConfig)
    resumed = Learner(cfg, ckpt, devices.resolve(cfg), ref_dir=loop_model_dir)
    initial = _learner(loop_model_dir).model.state_dict()
    ref = resumed.ref_model.state_dict()
    assert all(torch.equal(ref[k], initial[k]) for k in initial)
    assert not all(torch.equal(resumed.model.state_dict()[k], initial[k]) for k in initial)
