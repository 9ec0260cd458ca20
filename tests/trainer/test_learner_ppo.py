"""Several PPO updates per batch (``ppo_epochs`` x ``minibatches``) against the proximal policy, and the
per-sample staleness weight: on the real tiny Llama (CPU), one rank and two (FSDP2 over gloo)."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from services.trainer import batching, devices
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.step_input import StepInput
from tests.distributed.rank_script import batch
from tests.distributed.test_ranks import _max_diff, _run, _weights


def _learner(model_dir, **groups) -> Learner:
    cfg = msgspec.convert({"devices": {"num_threads": 1, "device": "cpu"}, **groups}, TrainerConfig)
    return Learner(cfg, model_dir, devices.resolve(cfg))


def _adam_steps(learner: Learner) -> int:
    return int(next(iter(learner.optimizer.state.values()))["step"])


def test_minibatches_cover_the_batch_once_balanced_by_tokens():
    lengths = [9, 1, 5, 5, 3, 7, 2, 8]
    parts = batching.minibatches(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(8))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)
    assert batching.minibatches([4, 4], 5) == [[0], [1]]  # never an empty minibatch


def test_one_update_per_batch_by_default(loop_model_dir):
    learner = _learner(loop_model_dir)
    m = learner.step_input(StepInput.of(batch(1), learner.cfg))
    assert _adam_steps(learner) == 1 and learner.scheduler.last_epoch == 1
    assert "optim/updates" not in m and m["policy/clip_frac"] == 0.0  # the ratio is 1: the clip never acts


def test_several_updates_take_the_ratio_against_the_proximal_policy(loop_model_dir):
    # 2 epochs x 2 minibatches = 4 AdamW steps, one lr-schedule step; at a large lr the later updates move
    # the policy past 1 + clip_high of the proximal policy, so the clip acts (it cannot with one update)
    learner = _learner(loop_model_dir, optim={"ppo_epochs": 2, "minibatches": 2, "lr": 3e-2},
                       loss={"is_mode": "decoupled"})
    inp = StepInput.of(batch(1), learner.cfg)
    parts = batching.minibatches(inp.lengths, 2)
    before = learner.proximal_logprobs(inp, parts)
    assert sorted(before) == list(range(len(inp.completions)))
    assert all(before[i].shape == (len(inp.completions[i]),) for i in before)
    m = learner.step_input(inp)
    assert m["optim/updates"] == 4.0 and _adam_steps(learner) == 4 and learner.scheduler.last_epoch == 1
    assert m["policy/clip_frac"] > 0.0
    after = learner.proximal_logprobs(inp, parts)
    assert max((after[i] - before[i]).abs().max().item() for i in before) > 1e-3  # the weights moved


def test_staleness_decay_weighs_samples_by_versions_behind_the_freshest():
    trajectories = batch(2, groups=1, group_size=3)
    for t, v in zip(trajectories, (3, 2, 1), strict=True):
        t.rollout.turns[0].versions = [v] * len(t.rollout.turns[0].token_ids)
    assert StepInput.of(trajectories, TrainerConfig()).weights == []  # off by default: all weigh 1
    decayed = StepInput.of(trajectories, msgspec.convert({"loss": {"staleness_decay": 0.5}}, TrainerConfig))
    assert decayed.weights == pytest.approx([1.0, 0.5, 0.25])


def test_staleness_decay_changes_the_loss(loop_model_dir):
    trajectories = batch(3)
    for k, t in enumerate(trajectories):
        t.rollout.turns[0].versions = [k % 2] * len(t.rollout.turns[0].token_ids)
    plain, _, _ = _learner(loop_model_dir).accumulate(StepInput.of(trajectories, TrainerConfig()))
    learner = _learner(loop_model_dir, loss={"staleness_decay": 0.5})
    weighted, _, _ = learner.accumulate(StepInput.of(trajectories, learner.cfg))
    assert weighted["losses/policy"] != pytest.approx(plain["losses/policy"], abs=1e-6)


def test_minibatches_larger_than_the_batch_are_refused():
    with pytest.raises(msgspec.ValidationError, match="services.trainer.optim.minibatches"):
        msgspec.convert({"optim": {"minibatches": 9}, "groups_per_step": 2, "group_size": 4}, TrainerConfig)


def test_two_ranks_make_the_same_ppo_updates_as_one(tmp_path, loop_model_dir):
    optim = {"ppo_epochs": 2, "minibatches": 2, "micro_batch_size": 3}
    one = _run(tmp_path, "one", loop_model_dir, 1, [1, 2], optim=optim)
    two = _run(tmp_path, "two", loop_model_dir, 2, [1, 2], optim=optim)
    from safetensors.torch import load_file

    initial = load_file(loop_model_dir / "model.safetensors")
    moved = _max_diff({k: v for k, v in _weights(one).items() if k in initial},
                      {k: v for k, v in initial.items() if k in _weights(one)})
    assert moved > 1e-4  # eight AdamW steps changed the weights ...
    assert _max_diff(_weights(one), _weights(two)) < moved / 50  # ... and 2 ranks changed them the same way
    m1, m2 = (json.loads((o / "metrics.json").read_text()) for o in (one, two))
    for a, b in zip(m1, m2, strict=True):
        assert a["optim/updates"] == b["optim/updates"] == 4.0
        assert abs(a["losses/total"] - b["losses/total"]) < 1e-5
    assert torch.isfinite(torch.tensor([m["policy/clip_frac"] for m in m1])).all()
