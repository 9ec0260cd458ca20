"""LoRA adapters for the policy, through ``peft`` (not yet wired into the trainer service; see below).

With LoRA the optimiser trains two small matrices per targeted linear layer, ``A`` (r × in) and ``B``
(out × r), and the layer computes ``W x + (alpha / r) · B A x`` with ``W`` frozen. What that buys an RL
loop is measured by ``bench/lora.py``: the bytes one weight version costs on the bus when only the
adapter travels, against full weights (and their sparse deltas), and the optimiser step time.

This module is the library part: :func:`apply_lora` wraps a Hugging Face causal LM, :func:`adapter_state`
is what would travel per version, :func:`merged_state` is the full state dict (original names) that
engines load today, and :func:`save_adapter` / :func:`save_merged` are the two forms of a final model.
Still to do for the service: a ``lora`` key in the trainer's config, the learner building its model with
:func:`apply_lora`, and engines applying adapter versions (torch engine: merge into its weights; vLLM: its
LoRA support) so that only :func:`adapter_state` is sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
import torch

#: the linear layers of Llama/Qwen/Mistral-style decoders
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """LoRA settings (what ``[services.trainer] lora = { ... }`` would hold)."""

    #: rank of the adapter matrices
    r: Annotated[int, msgspec.Meta(ge=1)] = 8
    #: scale numerator: the update is (alpha / r) · B A
    alpha: Annotated[float, msgspec.Meta(gt=0)] = 16.0
    #: dropout on the adapter's input during training
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    #: names (suffixes) of the linear modules that get adapters
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_TARGETS))


class LoraError(ValueError):
    """LoRA cannot be applied (peft missing, or no module matches ``target_modules``)."""


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    """``model`` wrapped by peft with fresh adapters (``B`` starts at zero: the wrapped model computes exactly
    what ``model`` did); only adapter parameters require grad."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError:
        raise LoraError("LoRA needs the 'peft' package: pip install 'rlbus[lora]' (or pip install peft)") from None
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if not names & set(cfg.target_modules):
        raise LoraError(f"lora.target_modules {cfg.target_modules} match no linear layer of the model "
                        f"(its linear layers: {', '.join(sorted(names))})")
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=[t for t in cfg.target_modules if t in names], bias="none",
                              task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors only (what one version costs on the bus when engines apply adapters)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def _base_name(key: str) -> str:
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The full state dict with the adapters merged into the base weights, under the base model's names
    (what an engine without adapter support loads). The wrapped model is left as it was."""
    model.merge_adapter()
    try:
        return {_base_name(k): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    finally:
        model.unmerge_adapter()


def save_adapter(model: Any, directory: str | Path) -> None:
    """An adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), loadable by peft."""
    model.save_pretrained(str(directory))


def save_merged(model: Any, tokenizer: Any, directory: str | Path) -> None:
    """A plain Hugging Face model directory with the adapters merged in (the wrapped model is unchanged)."""
    model.merge_adapter()
    try:
        base = model.get_base_model()
        state = {_base_name(k): v for k, v in model.state_dict().items() if "lora_" not in k}
        base.save_pretrained(str(directory), state_dict=state)
    finally:
        model.unmerge_adapter()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
