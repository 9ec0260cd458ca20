"""LoRA adapters for the policy, through ``peft`` (``[services.trainer] lora = { r, alpha, dropout, target_modules }``).

With LoRA the optimiser trains two small matrices per targeted linear layer, ``A`` (r × in) and ``B``
(out × r), and the layer computes ``W x + (alpha / r) · B A x`` with ``W`` frozen. What that buys an RL
loop is measured by ``bench/lora.py``: the bytes one weight version costs on the bus when only the
adapter travels, against full weights (and their sparse deltas), and the optimiser step time.

:func:`apply_lora` wraps a Hugging Face causal LM (the learner's model when ``lora`` is set);
:func:`wire_state` is what travels per weight version (the adapter tensors in the form of
:mod:`services.lib.weights.lora_merge`, which engines merge into the base weights they keep) and
:func:`load_wire_state` puts such a version back into the wrapped model (a resumed trainer);
:func:`merged_state` is the full state dict under the base model's names; :func:`save_adapter` /
:func:`save_merged` are the two forms of a final model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.lib.weights import lora_merge
from services.trainer.config import DEFAULT_LORA_TARGETS as DEFAULT_TARGETS
from services.trainer.config import LoraConfig

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "LoraError", "adapter_state", "apply_lora", "load_wire_state",
           "merged_state", "save_adapter", "save_merged", "wire_state"]

_PREFIX = "base_model.model."


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
    return key.removeprefix(_PREFIX).replace(".base_layer.", ".")


def wire_state(model: Any, cfg: LoraConfig, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter as one weight version (:mod:`services.lib.weights.lora_merge`'s form): per adapted
    weight ``<name>.lora_A`` / ``<name>.lora_B`` (cast to ``dtype`` if given) and the settings."""
    pairs: dict[str, list[torch.Tensor]] = {}
    for key, t in adapter_state(model).items():
        for half, index in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if key.endswith(half):
                name = key.removeprefix(_PREFIX)[: -len(half)] + ".weight"
                pairs.setdefault(name, [torch.empty(0), torch.empty(0)])[index] = t if dtype is None else t.to(dtype)
    targets = sorted(model.peft_config["default"].target_modules)
    meta = lora_merge.AdapterMeta(r=cfg.r, alpha=cfg.alpha, target_modules=targets)
    return lora_merge.pack({k: (a, b) for k, (a, b) in pairs.items()}, meta)


def load_wire_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load an adapter version (:func:`wire_state`'s form) into the wrapped ``model``; its rank and
    adapted weights must be the model's."""
    from peft import set_peft_model_state_dict

    meta, pairs = lora_merge.unpack(state)
    ours = adapter_state(model)
    peft_sd: dict[str, torch.Tensor] = {}
    for name, (a, b) in pairs.items():
        stem = _PREFIX + name.removesuffix(".weight")
        peft_sd[stem + ".lora_A.weight"], peft_sd[stem + ".lora_B.weight"] = a, b
    if peft_sd.keys() != ours.keys():
        odd = sorted(peft_sd.keys() ^ ours.keys())
        raise LoraError(f"the adapter version does not match this model's adapters (r = {meta.r}; differs at "
                        f"{odd[:2]}): lora.r and lora.target_modules must be the run's")
    for k, t in peft_sd.items():
        if tuple(t.shape) != tuple(ours[k].shape):
            raise LoraError(f"adapter tensor {k} has shape {tuple(t.shape)}, this model's {tuple(ours[k].shape)}: "
                            "lora.r must be the run's")
    set_peft_model_state_dict(model, {k: t.to(ours[k].dtype) for k, t in peft_sd.items()})


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
