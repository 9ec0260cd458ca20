"""Load and save the policy as a Hugging Face directory, and score completions.

* :func:`load_policy` reads a causal LM + tokenizer from a local directory
  (never the Hub) in fp32 or bf16.
* :func:`save_policy` writes safetensors + config + tokenizer atomically, so a
  reader never sees a half-written directory; ``AutoModelForCausalLM.from_pretrained``
  loads the result.
* :func:`sequence_logprobs` computes per-token logprobs of completion tokens for
  a batch of ``(prompt_ids, completion_ids)`` pairs, the input of the loss.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("rlbus.trainer.model_io")

DType = Literal["float32", "bfloat16"]
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelIOError(RuntimeError):
    """A model directory is missing, incomplete or could not be written."""


def torch_dtype(dtype: DType | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"`` (or a torch dtype) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelIOError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_policy(
    model_dir: str | os.PathLike[str],
    dtype: DType | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a local Hugging Face directory.

    Args:
        model_dir: a directory holding ``config.json``, weights and tokenizer files.
        dtype: ``"float32"`` or ``"bfloat16"``; the weights are cast on load.
        device: where to place the model.

    Raises:
        ModelIOError: the directory does not exist or has no ``config.json``.
    """
    from services.runtime.loading import HF_LOAD_LOCK

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelIOError(
            f"{path} is not a Hugging Face model directory (no config.json); build or download it first"
        )
    with HF_LOAD_LOCK:  # colocated services load in threads of one process
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.to(device)
    return model, tokenizer


def save_policy(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | os.PathLike[str],
    state_dict: dict[str, Tensor] | None = None,
) -> Path:
    """Save model (safetensors + config + generation config) and tokenizer to ``out_dir``.

    The directory is written next to its destination and renamed into place, so
    it appears complete or not at all; an existing ``out_dir`` is replaced.
    ``state_dict`` (full tensors) replaces the model's own, e.g. the weights gathered
    from a model sharded over several ranks.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if state_dict is None:
            model.save_pretrained(staging, safe_serialization=True)
        else:
            model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if out.exists():
            retired = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, retired)
            os.replace(staging, out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelIOError(f"could not save the model to {out}: {exc}") from exc
    return out


def pack_right_padded(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_token_id: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pack ``prompt + completion`` rows, right-padded to the longest row.

    Returns:
        ``(input_ids [B, L], attention_mask [B, L], prompt_lens [B], completion_lens [B])``.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError(
            "every prompt needs at least one token (e.g. BOS) to condition the first completion token"
        )
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
    prompt_lens = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    completion_lens = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
    return input_ids, attention_mask, prompt_lens, completion_lens


def sequence_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    completion_masks: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    chunk_positions: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token logprobs of the completion tokens under ``model``.

    Each row is ``prompt + completion``, right-padded; only the logits of the
    window that holds completion tokens are computed (``logits_to_keep``), and
    log-softmax runs in float32 whatever the model's dtype, a chunk of positions at a time
    (:func:`token_logprobs`: no full-vocabulary float32 copy of the logits). Gradients flow unless
    the caller wraps this in ``torch.no_grad()``.

    Args:
        model: a Hugging Face causal LM.
        prompt_ids: ``B`` prompts (token ids, each non-empty).
        completion_ids: ``B`` completions (token ids, may be empty).
        completion_masks: optional per-token 0/1 per completion (0 for tool-output
            tokens); default all ones.
        pad_token_id: id used for padding (masked out by attention anyway).
        temperature: logits are divided by this, to match the sampling distribution
            the rollout engine recorded its behaviour logprobs under.
        chunk_positions: completion positions whose vocabulary-wide float32 scratch exists at
            once (:func:`token_logprobs`; default: as many as fit :data:`CHUNK_ELEMENTS`).

    Returns:
        ``(logprobs [B, T], loss_mask [B, T])`` with ``T`` the longest completion;
        ``logprobs[i, j]`` is log p(completion_i[j] | prompt_i, completion_i[:j]), and
        ``loss_mask`` is 0 on padding (and where ``completion_masks`` is 0).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    input_ids, attention_mask, prompt_lens, completion_lens = pack_right_padded(
        prompt_ids, completion_ids, pad_token_id
    )
    batch, width = input_ids.shape
    max_completion = int(completion_lens.max()) if batch else 0
    loss_mask = completion_loss_mask(completion_lens.tolist(), completion_masks)
    if max_completion == 0:
        return torch.zeros((batch, 0), device=device), loss_mask.to(device)

    # Token j of completion i sits at column p_i + j and is predicted by the logits at p_i + j - 1.
    first = int(prompt_lens.min()) - 1
    keep = width - first
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        logits_to_keep=keep,
        use_cache=False,
    )
    # [B, keep, V] in the model's dtype; column k is sequence position first + k
    j = torch.arange(max_completion).unsqueeze(0)
    position = (prompt_lens.unsqueeze(1) - 1 + j).clamp(max=width - 2)  # predicting column
    target = input_ids.gather(1, position + 1)  # the completion token itself (pad beyond its end)
    logprobs = token_logprobs(out.logits, (position - first).to(device), target.to(device), temperature,
                              chunk_positions=chunk_positions)
    loss_mask = loss_mask.to(device)
    return logprobs * loss_mask, loss_mask


def completion_loss_mask(completion_lens: Sequence[int], completion_masks: Sequence[Sequence[int]] | None) -> Tensor:
    """``[B, T]`` float32: 1 on each completion's tokens (times ``completion_masks`` where given), 0 on padding."""
    lens = torch.tensor(list(completion_lens), dtype=torch.long)
    loss_mask = (torch.arange(int(lens.max()) if len(lens) else 0).unsqueeze(0) < lens.unsqueeze(1)).float()
    if completion_masks is not None:
        for i, row_mask in enumerate(completion_masks):
            if len(row_mask) != int(lens[i]):
                raise ValueError(f"completion_masks[{i}] has {len(row_mask)} entries for {int(lens[i])} tokens")
            loss_mask[i, : len(row_mask)] *= torch.tensor(row_mask, dtype=torch.float32)
    return loss_mask


#: float32 elements of vocabulary-wide scratch one chunk of :func:`token_logprobs` may use (256 MiB)
CHUNK_ELEMENTS = 1 << 26


def token_logprobs(logits: Tensor, rows: Tensor, targets: Tensor, temperature: float = 1.0, *,
                   chunk_positions: int | None = None) -> Tensor:
    """``log_softmax(logits[b, rows[b, t]] / temperature)[targets[b, t]]`` as a float32 ``[B, T]`` tensor.

    The plain expression makes three or four float32 copies of the vocabulary-wide logits (the cast, the
    division, the gathered rows, logsumexp's scratch): ~10 GB each at 16 k tokens × 152 k vocabulary. Here
    the rows are taken ``chunk_positions`` sequence positions at a time (default: as many as keep the
    float32 scratch under :data:`CHUNK_ELEMENTS`), so the only vocabulary-wide tensors are ``logits`` itself
    (in the model's dtype) and, in the backward, its gradient (same dtype), written chunk by chunk:
    ``d logp / d x_v = ([v = target] - softmax(x)_v) / temperature``.

    Args:
        logits: ``[B, K, V]``, any floating dtype.
        rows: ``[B, T]`` indices into ``K`` (may repeat: padding positions point at the last column).
        targets: ``[B, T]`` token ids into ``V``.
    """
    if chunk_positions is not None and chunk_positions < 1:
        raise ValueError(f"chunk_positions must be >= 1, got {chunk_positions}")
    batch, _, vocab = logits.shape
    chunk = chunk_positions or max(1, CHUNK_ELEMENTS // max(batch * vocab, 1))
    return _TokenLogprobs.apply(logits, rows, targets, float(temperature), chunk)


def _chunk_rows(logits: Tensor, rows: Tensor, temperature: float) -> Tensor:
    """``logits[b, rows[b, t]] / temperature`` in float32: ``[B, c, V]`` (one chunk)."""
    batch = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1)
    x = logits[batch, rows].float()
    return x.div_(temperature) if temperature != 1.0 else x


class _TokenLogprobs(torch.autograd.Function):
    """:func:`token_logprobs`: forward and backward chunk by chunk (saves ``logits`` and the logsumexp only)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, rows: Tensor, targets: Tensor, temperature: float,
                chunk: int) -> Tensor:
        out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for lo in range(0, rows.shape[1], chunk):
            x = _chunk_rows(logits, rows[:, lo : lo + chunk], temperature)  # [B, c, V]
            lse[:, lo : lo + chunk] = torch.logsumexp(x, dim=-1)
            out[:, lo : lo + chunk] = x.gather(-1, targets[:, lo : lo + chunk, None]).squeeze(-1)
            del x
        out -= lse
        ctx.save_for_backward(logits, rows, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        logits, rows, targets, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        batch = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1)
        for lo in range(0, rows.shape[1], ctx.chunk):
            r, g_out = rows[:, lo : lo + ctx.chunk], grad_out[:, lo : lo + ctx.chunk, None].float()
            # d/dx of x[target] - logsumexp(x) is onehot(target) - softmax(x); then the 1/temperature
            g = _chunk_rows(logits, r, ctx.temperature).sub_(lse[:, lo : lo + ctx.chunk, None]).exp_()
            g.mul_(-g_out).scatter_add_(-1, targets[:, lo : lo + ctx.chunk, None], g_out)
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            grad.index_put_((batch.expand_as(r), r), g.to(grad.dtype), accumulate=True)  # rows may repeat
            del g
        return grad, None, None, None, None
