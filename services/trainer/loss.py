"""The GRPO-family objective, written to read like the maths.

Notation (one completion ``i`` of a prompt group ``g``, token ``t`` of it):

* ``r_i``                 the completion's reward;
* ``A_i``                 its advantage, shared by all of its tokens (or ``A_i(t)``, one per token: on-policy
  distillation's, :mod:`services.trainer.distill`);
* ``log pi_theta(t)``     ``logprobs``: the policy being trained (carries the gradient);
* ``log pi_prox(t)``      ``old_logprobs``: the proximal ("old") policy the PPO ratio is
  taken against. The learner passes it when it makes several optimiser steps per batch
  (``ppo_epochs`` / ``minibatches``): the policy before the batch's first update, so the
  clip bounds how far the updates move from it (decoupled PPO). When not given it is the
  current policy, detached (one optimiser step per batch: the clip never acts), except
  for ``is_mode="none"`` where it is the behaviour policy;
* ``log mu(t)``           ``behaviour_logprobs``: the policy that actually sampled the
  token, as recorded by the rollout engine (possibly several versions stale);
* ``log pi_ref(t)``       ``ref_logprobs``: a frozen reference, for the KL penalty;
* ``m(t)``                ``loss_mask``: 1 for policy-sampled completion tokens, 0 for prompt,
  padding and tool-output tokens;
* ``s_i``                 ``sample_weights``: a per-completion weight (default 1), e.g. a
  decay with the sample's staleness.

Per token, for ``type = "grpo"`` (and ``"dr_grpo"``, which differs only in advantages and normaliser)::

    rho(t)  = exp(log pi_theta(t) - log pi_prox(t))                  # PPO ratio
    pg(t)   = -min(rho(t) * A_i, clip(rho(t), 1 - clip_low, 1 + clip_high) * A_i)
    w(t)    = importance weight of the proximal policy against the behaviour policy, times the
              train-inference mismatch mask (detached; see ``is_mode`` and :mod:`services.trainer.mismatch`)
    kl(t)   = exp(d) - d - 1,  d = log pi_ref(t) - log pi_theta(t)   # k3 estimator, >= 0
    l(t)    = s_i * w(t) * pg(t) + kl_coef * kl(t)

The other policy terms (``loss_type``), in the same notation (``sg`` = stop-gradient, ``mean_t`` = the mean over
completion ``i``'s loss tokens):

* ``"gspo"`` (Group Sequence Policy Optimisation, Zheng et al. 2025): one ratio per completion, the geometric
  mean of its token ratios, clipped per completion::

      rho_i = exp(mean_t (log pi_theta(t) - log pi_prox(t)))
      pg(t) = -min(rho_i * A_i, clip(rho_i, 1 - clip_low, 1 + clip_high) * A_i)   # the same for every token of i

  and ``w`` is taken per completion too: ``is_mode``'s weight of ``exp(mean_t (log pi_prox - log mu))``. With
  ``seq_mean_token_mean`` (the only aggregation allowed) completion ``i`` contributes ``s_i w_i pg_i``, whose
  gradient is ``-s_i w_i A_i rho_i mean_t grad log pi_theta(t)`` where unclipped: length-normalised. The GSPO
  paper clips far tighter than token PPO (``clip_low = 3e-4``, ``clip_high = 4e-4``).
* ``"cispo"`` (MiniMax-M1, 2025): the clipped ratio is a detached weight on a REINFORCE term, so no token loses
  its gradient to the clip::

      pg(t) = -sg(clip(rho(t), 1 - clip_low, 1 + clip_high)) * A_i * log pi_theta(t)

  (its value is not comparable with the PPO surrogate's; its gradient is ``-clip(rho) A_i grad log pi_theta``).
* ``"dr_grpo"`` (Dr. GRPO, Liu et al. 2025): the GRPO term, advantages not divided by the group's std
  (``normalize_std = false``) and a constant normaliser (``aggregation = "seq_mean_token_sum_norm"``), so
  neither a group's spread nor a completion's length rescales its gradient.

``is_mode``:

* ``"tis"`` (default), truncated importance sampling:
  ``w = min(exp(log pi_prox - log mu), is_cap)``; every token is kept, large weights are
  truncated to the cap.
* ``"decoupled"``, decoupled PPO (Hilton et al. 2022; AReaL):
  ``w = exp(log pi_prox - log mu)`` where it is at most ``is_cap`` and the token is dropped
  (``w = 0``) where it exceeds the cap, so a token far off the behaviour policy
  contributes nothing rather than a truncated amount.
* ``"icepop"`` (IcePop, Ling team 2025): as decoupled, but two-sided: dropped outside ``[is_floor, is_cap]``.
* ``"none"``: ``w = 1`` (classic PPO: the behaviour policy is the old policy).

``mismatch_mask`` (masked importance sampling, MIS) multiplies ``w`` by 0 where the ratio of the trainer's
policy to ``mu`` leaves ``[mismatch_low, mismatch_high]``: per token, or per completion on the product or the
geometric mean of its token ratios (:mod:`services.trainer.mismatch`).

Aggregation of ``l(t)`` over the batch (``aggregation``):

* ``"seq_mean_token_mean"`` (default): mean over each completion's own tokens, then mean
  over completions. In this project's runs this learnt where the all-token mean
  collapsed at high learning rates.
* ``"token_mean"``: one mean over every loss token in the batch (longer completions
  weigh more).
* ``"seq_mean_token_sum_norm"``: each completion's token *sum* divided by the constant ``norm_tokens`` (e.g.
  the completion budget), then mean over completions (Dr. GRPO's normaliser).

**Segments.** An episode whose context was rewritten on the way (a black-box agent that truncated its history)
trains as several rows, one per segment, each with its own prompt and mask; all of them carry the episode's
advantage ``A_i`` (the episode is the group member). The aggregations treat the segments as the episode's
tokens, so splitting an episode never changes its weight in the batch: ``token_mean`` counts each of the
episode's loss tokens once, as always; the ``seq_mean`` aggregations count the *episode* once: its rows' token
sums are divided by the episode's loss tokens ``N_i`` (``episode_tokens``; ``seq_mean_token_mean``) or by
``norm_tokens``, and the batch's denominator counts each row as its share ``n_row / N_i`` of an episode, so an
episode of segments with ``n_1 + n_2 = N_i`` loss tokens contributes exactly what one sequence of those ``N_i``
tokens would. ``gspo``'s ratio and the ``sequence``/``geometric`` mismatch masks are per row (per segment).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

from services.trainer.mismatch import (
    IsMode,
    MismatchMask,
    is_weight,
    mismatch_metrics,
    rejection_mask,
    seq_mean,
)

LossType = Literal["grpo", "dr_grpo", "gspo", "cispo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]


class LossInputError(ValueError):
    """The loss was given tensors of mismatched shapes or an unknown option."""


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages, one per completion.

    ``A_i = r_i - mean_g(r)`` and, with ``normalize_std``, divided by ``std_g(r) + eps``
    where ``std_g`` is the sample standard deviation (Bessel-corrected, as in
    DeepSeekMath/TRL). A group of one completion, or one whose rewards are all equal,
    gets advantage 0 for every member.

    Args:
        rewards: ``[N]`` per-completion rewards.
        group_ids: ``N`` hashable group keys (e.g. the prompt group id), or an int tensor.
        normalize_std: divide by the group's reward std (Dr. GRPO turns this off).
        eps: added to the std to keep the division finite.

    Returns:
        ``[N]`` float32 advantages, in the order of ``rewards``.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if isinstance(group_ids, Tensor):
        group_ids = group_ids.tolist()
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise LossInputError(
            f"rewards must be 1-D with one group id each; got rewards {tuple(rewards.shape)} "
            f"and {len(group_ids)} group ids"
        )
    # Map each group key to a dense index 0..G-1.
    index: dict[Hashable, int] = {}
    group = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    num_groups = len(index)
    # Per-group count, mean and (Bessel-corrected) std via scatter-add.
    count = torch.zeros(num_groups).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    advantages = centred
    if normalize_std:
        sq = torch.zeros(num_groups).index_add_(0, group, centred**2)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        # Equal rewards (std 0) mean no signal: advantage 0, even with eps = 0.
        spread = std[group]
        advantages = torch.where(spread > 0, centred / (spread + eps), torch.zeros_like(centred))
    # A singleton group has no baseline to compare against: no signal.
    return torch.where(count[group] > 1, advantages, torch.zeros_like(advantages))


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: Aggregation, total: float | None,
               norm_tokens: float = 0.0, episode_tokens: Tensor | None = None) -> Tensor:
    """Reduce a ``[B, T]`` per-token quantity to a scalar (see module docstring); ``episode_tokens``: per row,
    the loss tokens of the episode it is a segment of (None: every row is a whole episode)."""
    if aggregation == "token_mean":
        denominator = total if total is not None else mask.sum().clamp(min=1.0)
        return (per_token * mask).sum() / denominator
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        tokens_per_seq = mask.sum(dim=1)
        per_seq = (per_token * mask).sum(dim=1)
        # an episode of several segments counts once: each segment's share of it is its part of the tokens
        episode = tokens_per_seq if episode_tokens is None else episode_tokens.to(per_token.dtype)
        if aggregation == "seq_mean_token_mean":
            per_seq = per_seq / episode.clamp(min=1.0)
        else:
            if norm_tokens <= 0:
                raise LossInputError(f"aggregation 'seq_mean_token_sum_norm' needs norm_tokens > 0, got {norm_tokens}")
            per_seq = per_seq / norm_tokens
        # Completions without a single loss token (e.g. all tool output) do not count.
        share = torch.where(episode > 0, tokens_per_seq / episode.clamp(min=1.0), torch.zeros_like(episode))
        denominator = total if total is not None else share.sum().clamp(min=1.0)
        return (per_seq * (tokens_per_seq > 0).to(per_token.dtype)).sum() / denominator
    raise LossInputError(f"unknown aggregation {aggregation!r}; use 'seq_mean_token_mean', 'token_mean' or "
                         "'seq_mean_token_sum_norm'")


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    sample_weights: Tensor | None = None,
    loss_type: LossType = "grpo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kl_coef: float = 0.0,
    is_mode: IsMode = "tis",
    is_cap: float = 2.0,
    is_floor: float = 0.5,
    mismatch_mask: MismatchMask = "none",
    mismatch_low: float = 0.5,
    mismatch_high: float = 2.0,
    aggregation: Aggregation = "seq_mean_token_mean",
    norm_tokens: float = 0.0,
    total: float | None = None,
    episode_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO-family loss with clip-higher, optional k3 KL, off-policy and mismatch correction.

    Formulas are in the module docstring. All per-token tensors are ``[B, T]``
    (completion tokens, right-padded); ``advantages`` is ``[B]`` (from
    :func:`group_advantages`, computed over whole groups, so it is an input here
    rather than recomputed from a micro-batch).

    Args:
        logprobs: current-policy logprobs of the sampled tokens; carries the gradient.
        behaviour_logprobs: logprobs recorded by the rollout engine when sampling.
        advantages: per-completion advantages ``[B]``, or per-token ones ``[B, T]`` (distillation).
        loss_mask: 1 where a token counts, 0 for prompt/padding/tool-output tokens.
        old_logprobs: proximal-policy logprobs; default: see module docstring.
        ref_logprobs: frozen-reference logprobs; needed when ``kl_coef > 0``.
        sample_weights: ``[B]`` per-completion weights of the policy term (default: all 1).
        loss_type: the policy term: ``"grpo"``, ``"dr_grpo"`` (the same term), ``"gspo"`` or ``"cispo"``.
        clip_low: ratio floor is ``1 - clip_low``.
        clip_high: ratio ceiling is ``1 + clip_high`` (clip-higher when > clip_low).
        kl_coef: weight of the k3 KL penalty to the reference.
        is_mode: ``"tis"``, ``"decoupled"``, ``"icepop"`` or ``"none"``.
        is_cap: cap on the importance weight (truncated for tis, dropped above for decoupled and icepop).
        is_floor: icepop drops tokens whose importance weight is below it.
        mismatch_mask: ``"none"``, ``"token"``, ``"sequence"`` or ``"geometric"`` (MIS).
        mismatch_low, mismatch_high: the interval of ratios the mismatch mask keeps.
        aggregation: ``"seq_mean_token_mean"``, ``"token_mean"`` or ``"seq_mean_token_sum_norm"``.
        norm_tokens: the constant normaliser of ``"seq_mean_token_sum_norm"``.
        total: denominator for the whole batch when this call sees only a micro-batch
            of it (gradient accumulation): the number of completions with loss tokens
            (the seq_mean aggregations; an episode of several segments counts once) or of loss tokens
            (token_mean) in the full batch.
        episode_tokens: ``[B]``, per row the loss tokens of its whole episode, when rows are segments of
            episodes (see "Segments" above); None: every row is an episode of its own.

    Returns:
        ``(loss, metrics)``: a scalar tensor to call ``backward()`` on, and floats named
        ``losses/policy``, ``losses/kl``, ``losses/total``, ``policy/clip_frac``,
        ``policy/approx_kl``, ``policy/is_weight_mean``, ``policy/is_truncated_frac`` (tokens whose
        raw weight exceeded ``is_cap``: truncated for tis, dropped for decoupled and icepop),
        ``policy/entropy`` (sampled-token estimate ``mean(-log pi_theta)``, exact in
        expectation for on-policy samples), ``policy/advantage_abs_mean`` and the ``mismatch/`` figures of
        :mod:`services.trainer.mismatch`.
    """
    shape = logprobs.shape
    for name, tensor in (
        ("behaviour_logprobs", behaviour_logprobs),
        ("loss_mask", loss_mask),
        ("old_logprobs", old_logprobs),
        ("ref_logprobs", ref_logprobs),
    ):
        if tensor is not None and tensor.shape != shape:
            raise LossInputError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(shape)}")
    if logprobs.dim() != 2 or advantages.shape not in (shape[:1], shape):
        raise LossInputError(
            f"expected logprobs [B, T] and advantages [B] or [B, T]; got {tuple(shape)} and {tuple(advantages.shape)}"
        )
    if episode_tokens is not None and episode_tokens.shape != shape[:1]:
        raise LossInputError(f"episode_tokens has shape {tuple(episode_tokens.shape)}, expected [B] = {shape[:1]}")
    if sample_weights is not None and sample_weights.shape != shape[:1]:
        raise LossInputError(f"sample_weights has shape {tuple(sample_weights.shape)}, expected [B] = {shape[:1]}")
    if kl_coef > 0 and ref_logprobs is None:
        raise LossInputError("kl_coef > 0 needs ref_logprobs (the frozen reference policy's logprobs)")
    if is_mode not in ("tis", "decoupled", "icepop", "none"):
        raise LossInputError(f"unknown is_mode {is_mode!r}; use 'tis', 'decoupled', 'icepop' or 'none'")
    if loss_type not in ("grpo", "dr_grpo", "gspo", "cispo"):
        raise LossInputError(f"unknown loss_type {loss_type!r}; use 'grpo', 'dr_grpo', 'gspo' or 'cispo'")
    if loss_type == "gspo" and aggregation != "seq_mean_token_mean":
        raise LossInputError(f"loss_type 'gspo' takes one ratio per completion: it needs aggregation "
                             f"'seq_mean_token_mean', got {aggregation!r}")

    mask = loss_mask.to(logprobs.dtype)
    behaviour_logprobs = behaviour_logprobs.detach()
    # the trainer's policy before this batch's updates: what the mismatch with the engine is measured on
    train_logprobs = old_logprobs.detach() if old_logprobs is not None else logprobs.detach()

    # 1. The proximal policy the PPO ratio is taken against.
    if old_logprobs is not None:
        prox_logprobs = old_logprobs.detach()
    elif is_mode == "none":
        prox_logprobs = behaviour_logprobs
    else:
        prox_logprobs = logprobs.detach()

    # 2. The ratio and the policy term (per token; gspo: per completion, the same for each of its tokens).
    log_ratio = logprobs - prox_logprobs
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, T]: per-token advantages (distillation)
    if loss_type == "gspo":
        ratio = torch.exp(seq_mean(log_ratio, mask)).unsqueeze(1).expand_as(log_ratio)
    else:
        ratio = torch.exp(log_ratio)
    clamped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped, clipped = ratio * adv, clamped * adv
    if loss_type == "cispo":
        pg_per_token = -clamped.detach() * adv * logprobs
        clip_hit = clamped != ratio
    else:
        pg_per_token = -torch.minimum(unclipped, clipped)
        clip_hit = clipped < unclipped

    # 3. Off-policy correction (importance weight of proximal vs behaviour policy) and the mismatch mask (no gradient).
    prox_vs_mu = prox_logprobs - behaviour_logprobs
    if loss_type == "gspo":  # one weight per completion, from its geometric-mean ratio
        prox_vs_mu = seq_mean(prox_vs_mu, mask).unsqueeze(1).expand_as(prox_vs_mu)
    raw_weight = torch.exp(prox_vs_mu)
    weight = is_weight(raw_weight, is_mode, is_cap, is_floor)
    is_truncated = (raw_weight > is_cap).to(mask.dtype) if is_mode != "none" else torch.zeros_like(mask)
    train_vs_mu = train_logprobs - behaviour_logprobs
    keep = rejection_mask(train_vs_mu, mask, mismatch_mask, mismatch_low, mismatch_high)
    dropped = (weight == 0) if is_mode in ("decoupled", "icepop") else torch.zeros_like(mask, dtype=torch.bool)
    zeroed = (dropped | (keep == 0)).to(mask.dtype)
    weight = weight * keep
    pg_per_token = weight * pg_per_token
    if sample_weights is not None:  # per-completion weight (e.g. staleness decay), no gradient
        pg_per_token = sample_weights.detach().to(pg_per_token.dtype).unsqueeze(1) * pg_per_token

    # 4. KL to the frozen reference (k3 estimator: unbiased, always >= 0).
    if ref_logprobs is not None:
        d = ref_logprobs.detach() - logprobs
        kl_per_token = torch.exp(d) - d - 1.0
    else:
        kl_per_token = torch.zeros_like(logprobs)

    # 5. Aggregate over tokens and completions.
    policy_loss = _aggregate(pg_per_token, mask, aggregation, total, norm_tokens, episode_tokens)
    kl_loss = _aggregate(kl_per_token, mask, aggregation, total, norm_tokens, episode_tokens)
    loss = policy_loss + kl_coef * kl_loss

    # Diagnostics: token means over loss tokens of this call.
    with torch.no_grad():
        n_tokens = mask.sum().clamp(min=1.0)

        def token_mean(x: Tensor) -> float:
            return float((x * mask).sum() / n_tokens)

        metrics = {
            "losses/policy": float(policy_loss),
            "losses/kl": float(kl_loss),
            "losses/total": float(loss),
            "policy/clip_frac": token_mean(clip_hit.to(mask.dtype)),
            "policy/approx_kl": token_mean(torch.exp(log_ratio) - 1.0 - log_ratio),
            "policy/is_weight_mean": token_mean(weight),
            "policy/is_truncated_frac": token_mean(is_truncated),
            "policy/entropy": token_mean(-logprobs),
            "policy/advantage_abs_mean": (token_mean(adv.abs()) if adv.shape == shape else float(advantages.abs().mean())
                                          if advantages.numel() else 0.0),
            **mismatch_metrics(train_vs_mu, mask, zeroed),
        }
    return loss, metrics
