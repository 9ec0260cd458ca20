"""Optimiser, gradient clipping and learning-rate schedules for the trainer.

Thin builders over ``torch.optim``: AdamW with weight decay only on matrices
(not on biases, norms or other 1-D parameters), a warm-up + constant / linear /
cosine schedule as a ``LambdaLR``, and one :func:`optimizer_step` that clips,
steps (or skips a non-finite step) and reports metrics named by path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

log = logging.getLogger("rlbus.trainer.optim")

Schedule = Literal["constant", "linear", "cosine"]


class OptimConfigError(ValueError):
    """An optimiser or schedule setting is out of range."""


def build_optimizer(
    model: nn.Module,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    fused: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters.

    Weight decay applies to parameters with two or more dimensions only (weight
    matrices and embeddings); biases and norm scales are not decayed. ``fused``:
    the fused kernel (CUDA parameters; the trainer asks for it on CUDA only,
    ``services.trainer.devices.precision_defaults``), else torch's default.
    """
    if lr <= 0:
        raise OptimConfigError(f"lr must be > 0, got {lr}")
    if weight_decay < 0:
        raise OptimConfigError(f"weight_decay must be >= 0, got {weight_decay}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise OptimConfigError("the model has no trainable parameters")
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             fused=True if fused else None)


def lr_multiplier(
    step: int,
    schedule: Schedule = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The factor on the base learning rate at optimiser step ``step`` (0-based).

    Linear warm-up from ``1 / (warmup_steps + 1)`` up to 1 over ``warmup_steps``,
    then ``constant`` (1), or ``linear`` / ``cosine`` decay down to ``min_lr_ratio``
    at ``total_steps`` (held there afterwards).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise OptimConfigError(f"schedule {schedule!r} needs total_steps")
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise OptimConfigError(f"unknown schedule {schedule!r}; use 'constant', 'linear' or 'cosine'")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_schedule(
    optimizer: torch.optim.Optimizer,
    schedule: Schedule = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier`; call ``.step()`` after each optimiser step."""
    if warmup_steps < 0:
        raise OptimConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise OptimConfigError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise OptimConfigError(
            f"schedule {schedule!r} needs total_steps > warmup_steps; got total_steps={total_steps}, "
            f"warmup_steps={warmup_steps}"
        )
    lr_multiplier(0, schedule, warmup_steps, total_steps, min_lr_ratio)  # validates the name
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, schedule, warmup_steps, total_steps, min_lr_ratio)
    )


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Clip the global gradient norm to ``max_norm`` (if set); return the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is None or max_norm <= 0:
        norm = torch.nn.utils.get_total_norm([p.grad.detach() for p in params])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    # sharded parameters (FSDP2) give a DTensor: the norm over every rank's shard
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """Clip gradients, step the optimiser and schedule, and zero the gradients.

    A step whose gradient norm is not finite (NaN/inf) is skipped — the weights
    are left as they were — and reported as ``optim/skipped = 1``.

    Returns:
        ``optim/grad_norm`` (before clipping), ``optim/lr`` (the rate this step used)
        and ``optim/skipped``.
    """
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    lr = float(optimizer.param_groups[0]["lr"])
    skipped = not math.isfinite(grad_norm)
    if skipped:
        log.warning("skipping optimiser step: gradient norm is %s", grad_norm)
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"optim/grad_norm": grad_norm, "optim/lr": lr, "optim/skipped": float(skipped)}
