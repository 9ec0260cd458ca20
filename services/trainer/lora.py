"""LoRA adapters for the policy, through ``peft`` (``[services.trainer] lora = { r, alpha, dropout, target_modules }``).

With LoRA the optimiser trains two small matrices per targeted linear layer, ``A`` (r × in) and ``B``
(out × r), and the layer computes ``W x + (alpha / r) · B A x`` with ``W`` frozen. What that buys an RL
loop is measured by ``bench/lora.py``: the bytes one weight version costs on the bus when only the
adapter travels, against full weights (and their sparse deltas), and the optimiser step time.

:func:`apply_lora` wraps a Hugging Face causal LM (the learner's model when ``lora`` is set, before it is
sharded). From the wrapped model's state dict (its own on one rank, gathered onto rank 0 from many),
:func:`wire_from_state_dict` is what travels per weight version (the adapter tensors in the form of
:mod:`services.lib.weights.lora_merge`, which engines merge into the base weights they keep) and
:func:`merged_from_state_dict` the base model's state dict with the adapters merged in (the same sum the
engines form); :func:`check_fits` and :func:`peft_keys` put a version back (a resumed trainer);
:func:`save_adapter` writes the peft adapter directory. :func:`merged_state` / :func:`save_merged` are
peft's own merge (a reference for tests and benchmarks).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from services.lib.weights import lora_merge
from services.trainer.config import DEFAULT_LORA_TARGETS as DEFAULT_TARGETS
from services.trainer.config import LoraConfig

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "LoraError", "adapter_state", "apply_lora", "check_fits",
           "merged_from_state_dict", "merged_state", "peft_keys", "save_adapter", "save_merged", "targets_of",
           "wire_from_state_dict"]

_PREFIX = "base_model.model."


class LoraError(ValueError):
    """LoRA cannot be applied (peft missing, or no module matches ``target_modules``)."""


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> Any:
    """``model`` wrapped by peft with fresh adapters (``B`` starts at zero: the wrapped model computes exactly
    what ``model`` did); only adapter parameters require grad. ``A`` is drawn (peft's Kaiming-uniform) from a
    generator of its own seeded with ``seed``, so every rank of a sharded learner, and every process, starts
    from the same adapters whatever the global RNG did before."""
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
    wrapped = get_peft_model(model, peft_cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(wrapped.named_parameters()):
            if ".lora_A." in name:
                fresh = torch.empty(p.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
                p.copy_(fresh)
    return wrapped


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors only (what one version costs on the bus when engines apply adapters)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def _base_name(key: str) -> str:
    return key.removeprefix(_PREFIX).replace(".base_layer.", ".")


def _adapter_key(key: str) -> tuple[str, int] | None:
    """``(base weight name, 0 for A / 1 for B)`` of a peft adapter key (with the adapter's name ``default`` in
    it, as the model's own state dict has it, or without, as peft's adapter state dict has it); else None."""
    for half, index in (("lora_A", 0), ("lora_B", 1)):
        for suffix in (f".{half}.default.weight", f".{half}.weight"):
            if key.endswith(suffix):
                return key.removeprefix(_PREFIX)[: -len(suffix)] + ".weight", index
    return None


def wire_from_state_dict(state: dict[str, torch.Tensor], cfg: LoraConfig, targets: list[str],
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter as one weight version (:mod:`services.lib.weights.lora_merge`'s form), from the wrapped
    model's full state dict (on one rank, or gathered from many): per adapted weight ``<name>.lora_A`` /
    ``<name>.lora_B`` (cast to ``dtype`` if given), and the settings."""
    pairs: dict[str, list[torch.Tensor]] = {}
    for key, t in state.items():
        found = _adapter_key(key)
        if found is not None:
            pairs.setdefault(found[0], [torch.empty(0), torch.empty(0)])[found[1]] = (
                t.detach() if dtype is None else t.detach().to(dtype))
    meta = lora_merge.AdapterMeta(r=cfg.r, alpha=cfg.alpha, target_modules=sorted(targets))
    return lora_merge.pack({k: (a, b) for k, (a, b) in pairs.items()}, meta)


def targets_of(model: Any) -> list[str]:
    """The module names peft put adapters on (those of ``target_modules`` the model has)."""
    return sorted(model.peft_config["default"].target_modules)


def merged_from_state_dict(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapters merged in (:func:`lora_merge.merge`, the engines' sum),
    from the wrapped model's full state dict (one rank, or gathered)."""
    out = {_base_name(k): v.detach() for k, v in state.items() if "lora_" not in k}
    _, pairs = lora_merge.unpack(wire_from_state_dict(state, cfg, []))
    for name, (a, b) in pairs.items():
        out[name] = lora_merge.merge(out[name], a, b, cfg.alpha / cfg.r)
    return out


def peft_keys(state: dict[str, torch.Tensor], adapter_name: str = "") -> dict[str, torch.Tensor]:
    """An adapter version's tensors under the wrapped model's own keys (``adapter_name``: as in its state dict,
    e.g. ``default``; empty: as peft's adapter state dict names them)."""
    _, pairs = lora_merge.unpack(state)
    middle = f".{adapter_name}" if adapter_name else ""
    out: dict[str, torch.Tensor] = {}
    for name, (a, b) in pairs.items():
        stem = _PREFIX + name.removesuffix(".weight")
        out[f"{stem}.lora_A{middle}.weight"], out[f"{stem}.lora_B{middle}.weight"] = a, b
    return out


def check_fits(model_state: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """:class:`LoraError` unless the adapter version ``state`` has exactly the model's adapters and shapes
    (``model_state``: the wrapped model's state dict; on many ranks, shapes are the global ones)."""
    meta, _ = lora_merge.unpack(state)
    ours = {k: v for k, v in model_state.items() if _adapter_key(k) is not None}
    theirs = peft_keys(state, "default")
    if theirs.keys() != ours.keys():
        odd = sorted(theirs.keys() ^ ours.keys())
        raise LoraError(f"the adapter version does not match this model's adapters (r = {meta.r}; differs at "
                        f"{odd[:2]}): lora.r and lora.target_modules must be the run's")
    for k, t in theirs.items():
        if tuple(t.shape) != tuple(ours[k].shape):
            raise LoraError(f"adapter tensor {k} has shape {tuple(t.shape)}, this model's {tuple(ours[k].shape)}: "
                            "lora.r must be the run's")


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The full state dict with the adapters merged into the base weights, under the base model's names
    (what an engine without adapter support loads). The wrapped model is left as it was."""
    model.merge_adapter()
    try:
        return {_base_name(k): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    finally:
        model.unmerge_adapter()


def save_adapter(model: Any, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """An adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), loadable by peft;
    ``state_dict``: the model's full state dict gathered from many ranks (default: the model's own)."""
    if state_dict is None:
        model.save_pretrained(str(directory))
    else:
        model.save_pretrained(str(directory), state_dict=state_dict)


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
