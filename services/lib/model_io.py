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
from typing import TYPE_CHECKING, Literal

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
) -> tuple[Tensor, Tensor]:
    """Per-token logprobs of the completion tokens under ``model``.

    Each row is ``prompt + completion``, right-padded; only the logits of the
    window that holds completion tokens are computed (``logits_to_keep``), and
    log-softmax runs in float32 whatever the model's dtype. Gradients flow unless
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
    loss_mask = (torch.arange(max_completion).unsqueeze(0) < completion_lens.unsqueeze(1)).float()
    if completion_masks is not None:
        for i, row_mask in enumerate(completion_masks):
            if len(row_mask) != int(completion_lens[i]):
                raise ValueError(
                    f"completion_masks[{i}] has {len(row_mask)} entries for {int(completion_lens[i])} tokens"
                )
            loss_mask[i, : len(row_mask)] *= torch.tensor(row_mask, dtype=torch.float32)
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
    logits = out.logits.float()  # [B, keep, V], column k is sequence position first + k
    if temperature != 1.0:
        logits = logits / temperature
    j = torch.arange(max_completion).unsqueeze(0)
    position = (prompt_lens.unsqueeze(1) - 1 + j).clamp(max=width - 2)  # predicting column
    target = input_ids.gather(1, position + 1)  # the completion token itself (pad beyond its end)
    window = (position - first).to(device)
    picked = logits.gather(1, window.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, T, V]
    token_logits = picked.gather(2, target.to(device).unsqueeze(-1)).squeeze(-1)
    logprobs = token_logits - torch.logsumexp(picked, dim=-1)
    loss_mask = loss_mask.to(device)
    return logprobs * loss_mask, loss_mask
