"""Optimiser builders, LR schedules and the clipped, NaN-safe optimiser step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from services.trainer.optim import (
    OptimConfigError,
    build_lr_schedule,
    build_optimizer,
    lr_multiplier,
    optimizer_step,
)


def test_weight_decay_only_on_matrices():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    assert sum(len(g["params"]) for g in opt.param_groups) == 4


def test_lr_multiplier_warmup_then_schedules():
    # warm-up 3 steps: 1/4, 2/4, 3/4, then 1
    assert [lr_multiplier(s, "constant", 3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # linear from 1 at step 2 down to min 0.1 at step 12, held after
    assert lr_multiplier(2, "linear", 2, 12, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(7, "linear", 2, 12, 0.1) == pytest.approx(0.55)
    assert lr_multiplier(20, "linear", 2, 12, 0.1) == pytest.approx(0.1)
    # cosine half-way = (1 + cos(pi/2)) / 2 = 0.5
    assert lr_multiplier(5, "cosine", 0, 10) == pytest.approx(0.5)


def test_schedule_drives_the_optimizer_lr():
    model = nn.Linear(2, 2)
    opt = build_optimizer(model, lr=1.0)
    sched = build_lr_schedule(opt, "linear", warmup_steps=1, total_steps=5)
    lrs = []
    for _ in range(6):
        model(torch.ones(1, 2)).sum().backward()
        lrs.append(optimizer_step(model, opt, sched)["optim/lr"])
    assert lrs == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_bad_settings_are_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(OptimConfigError, match="lr"):
        build_optimizer(model, lr=0.0)
    with pytest.raises(OptimConfigError, match="total_steps"):
        build_lr_schedule(build_optimizer(model), "cosine", warmup_steps=10, total_steps=5)
    with pytest.raises(OptimConfigError, match="unknown schedule"):
        build_lr_schedule(build_optimizer(model), "bogus", total_steps=5)  # type: ignore[arg-type]


def test_step_clips_the_gradient_norm():
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # loss = 10 * sum(w . x) with x = (3, 4, 0): gradient (30, 40, 0), norm 50 -> clipped to norm 1
    (10 * model(torch.tensor([[3.0, 4.0, 0.0]]))).sum().backward()
    metrics = optimizer_step(model, opt, max_grad_norm=1.0)
    assert metrics["optim/grad_norm"] == pytest.approx(50.0)
    assert model.weight.detach().tolist()[0] == pytest.approx([-0.6, -0.8, 0.0])
    assert model.weight.grad is None


def test_non_finite_gradient_skips_the_step():
    model = nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, lr=0.1)
    (model(torch.ones(1, 2)) * float("nan")).sum().backward()
    metrics = optimizer_step(model, opt, max_grad_norm=1.0)
    assert metrics["optim/skipped"] == 1.0
    assert not math.isfinite(metrics["optim/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
