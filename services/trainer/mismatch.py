"""Off-policy correction and train-inference mismatch: the weight ``w(t)`` of :mod:`services.trainer.loss`.

The engine that sampled a completion (``mu``: vLLM or the torch engine, bf16, possibly a stale version) and the
trainer (``pi``) do not give the same probabilities to the same tokens. Per loss token, with
``d(t) = log pi(t) - log mu(t)`` and ``r(t) = exp(d(t))``::

    w(t)  = is_weight(r)  * M(t)

``is_weight`` (``is_mode``) corrects the proximal policy against the behaviour policy (``pi`` is then the
proximal policy ``pi_prox``):

* ``"tis"``: ``min(r, cap)`` (truncated IS); ``"decoupled"``: ``r`` where ``r <= cap``, else 0;
* ``"icepop"``: ``r`` where ``floor <= r <= cap``, else 0 (a two-sided token mask: a token the two
  policies disagree on in either direction gives no gradient);
* ``"none"``: 1.

``M(t)`` (``mismatch.mask``) is a rejection mask (masked importance sampling, MIS) on the ratio of the
trainer's policy *before this batch's updates* to ``mu`` (the same ``r`` except for ``is_mode = "none"``,
whose proximal policy is ``mu`` itself), 1 inside ``[low, high]`` and 0 outside:

* ``"token"``: per token, on ``r(t)``;
* ``"sequence"``: per completion, on the product ``exp(sum_t d(t))`` over its loss tokens;
* ``"geometric"``: per completion, on the geometric mean ``exp(mean_t d(t))`` (length-independent).

A weight of 0 removes a token's policy gradient; the batch's normaliser is unchanged (as for decoupled PPO).

Metrics of the mismatch itself, over the call's loss tokens: ``mismatch/kl`` (``k3 = r - 1 - log r``, an
estimate of ``KL(mu || pi)`` from tokens sampled by ``mu``, >= 0), ``mismatch/masked_frac`` (tokens given
weight 0 by the mask, ``icepop`` or ``decoupled``) and the quantiles ``mismatch/ratio_p05``, ``_p50``, ``_p95``
of ``r(t)``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

IsMode = Literal["tis", "decoupled", "icepop", "none"]
MismatchMask = Literal["none", "token", "sequence", "geometric"]


class MismatchInputError(ValueError):
    """An unknown option or bounds that do not make an interval."""


def seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """``[B, T] -> [B]``: each row's mean over its loss tokens (0 for a row without any)."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def is_weight(raw: Tensor, mode: IsMode, cap: float, floor: float = 0.0) -> Tensor:
    """The importance weight of the proximal policy against the behaviour policy, from the raw ratio ``r``."""
    zero = torch.zeros_like(raw)
    if mode == "tis":
        return torch.clamp(raw, max=cap)
    if mode == "decoupled":
        return torch.where(raw <= cap, raw, zero)
    if mode == "icepop":
        if not floor < cap:
            raise MismatchInputError(f"icepop needs floor < cap; got floor {floor}, cap {cap}")
        return torch.where((raw >= floor) & (raw <= cap), raw, zero)
    if mode == "none":
        return torch.ones_like(raw)
    raise MismatchInputError(f"unknown is_mode {mode!r}; use 'tis', 'decoupled', 'icepop' or 'none'")


def rejection_mask(log_ratio: Tensor, mask: Tensor, kind: MismatchMask, low: float, high: float) -> Tensor:
    """``M(t)``: 1 where the ratio (per token, or the completion's product or geometric mean) is in
    ``[low, high]``, else 0; ``[B, T]``, all 1 for ``"none"``."""
    if kind == "none":
        return torch.ones_like(log_ratio)
    if not 0.0 < low < high:
        raise MismatchInputError(f"the mismatch mask needs 0 < low < high; got low {low}, high {high}")
    lo, hi = torch.log(torch.tensor(low)), torch.log(torch.tensor(high))
    if kind == "token":
        inside = (log_ratio >= lo) & (log_ratio <= hi)
    elif kind in ("sequence", "geometric"):
        per_seq = (log_ratio * mask).sum(dim=1) if kind == "sequence" else seq_mean(log_ratio, mask)
        inside = ((per_seq >= lo) & (per_seq <= hi)).unsqueeze(1).expand_as(log_ratio)
    else:
        raise MismatchInputError(f"unknown mismatch mask {kind!r}; use 'none', 'token', 'sequence' or 'geometric'")
    return inside.to(log_ratio.dtype)


def mismatch_metrics(log_ratio: Tensor, mask: Tensor, zeroed: Tensor) -> dict[str, float]:
    """The figures of the module docstring; ``zeroed``: 1 where the correction gave a token weight 0."""
    keep = mask > 0
    n = keep.sum().clamp(min=1).to(log_ratio.dtype)
    d = log_ratio[keep].float()
    if d.numel() == 0:
        return {"mismatch/kl": 0.0, "mismatch/masked_frac": 0.0, "mismatch/ratio_p05": 1.0,
                "mismatch/ratio_p50": 1.0, "mismatch/ratio_p95": 1.0}
    r = torch.exp(d)
    q = torch.quantile(r, torch.tensor([0.05, 0.5, 0.95], dtype=r.dtype, device=r.device))
    k3 = (torch.expm1(d) - d).clamp(min=0.0)  # >= 0 exactly; the clamp takes rounding below 0 off near r = 1
    return {"mismatch/kl": float(k3.mean()),
            "mismatch/masked_frac": float((zeroed * mask).sum() / n),
            "mismatch/ratio_p05": float(q[0]), "mismatch/ratio_p50": float(q[1]), "mismatch/ratio_p95": float(q[2])}
