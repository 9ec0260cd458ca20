"""A model sharded over the trainer's ranks (FSDP2), loaded once and gathered layer by layer.

Loading: rank 0 alone reads the checkpoint (on its host); every other rank builds the model from its
config on the ``meta`` device (no memory, no initialisation), the model is sharded (``fully_shard`` per
decoder layer and on the root), the other ranks give their shards storage on their own device, and rank 0
sends every rank its shards (``set_model_state_dict(broadcast_from_rank0=True)``). Buffers the state dict
does not hold (rotary ``inv_freq``: computed in ``__init__``, not saved) are broadcast from rank 0 too.
No rank but rank 0 ever holds the full model, and no device ever holds more than one layer's full
weights (rank 0's layers are moved to its device one at a time while they are sharded).

Gathering (:func:`gather`): one parameter at a time, cast to the publishing dtype on the device first (a bf16
gather moves half the bytes of a float32 one), assembled on rank 0's device; ``keep`` picks the keys (LoRA:
the adapters only, never the frozen base).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from services.lib.model_io import ModelIOError, load_policy, torch_dtype


class ShardingError(RuntimeError):
    """The model cannot be sharded over the trainer's ranks."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one (the classes the model says never to split)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ShardingError(f"cannot find the decoder layers of {type(model).__name__} to shard (it names no "
                            "_no_split_modules); run it with world_size = 1")
    return layers


def shard(model: nn.Module, bf16: bool) -> None:
    """``fully_shard`` each decoder layer, then the root (bf16 mixed precision, float32 reductions, if ``bf16``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def _build_empty(model_dir: Path, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """``(model on the meta device, tokenizer)`` from ``model_dir``'s config: what ranks 1..N-1 start from."""
    from services.runtime.loading import HF_LOAD_LOCK

    if not (model_dir / "config.json").is_file():
        raise ModelIOError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    with HF_LOAD_LOCK:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


def load_sharded(model_dir: Path, rank: int, device: str, *, bf16: bool, dtype: str = "float32",
                 prepare: Callable[[nn.Module], nn.Module] | None = None) -> tuple[nn.Module, Any]:
    """``(this rank's sharded model, tokenizer)`` with weights stored in ``dtype`` (the policy: float32 master
    weights; the reference: the training dtype) and computed in bf16 if ``bf16``: rank 0 reads ``model_dir``,
    the others receive their shards from it. ``prepare`` (e.g. LoRA's wrapper) runs on every rank before sharding and
    must create the same parameters everywhere (rank 0's values are the ones every rank ends with).
    Every rank of the default process group calls this together."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if rank == 0:
        model, tokenizer = load_policy(model_dir, dtype=dtype, device="cpu")
    else:
        model, tokenizer = _build_empty(model_dir, torch_dtype(dtype))
    if prepare is not None:
        model = prepare(model)
    # rank 0's full weights, kept on its host (they are the checkpoint it read) until every rank has its shards
    full = {k: v.detach() for k, v in model.state_dict().items()} if rank == 0 else {}
    shard(model, bf16)  # rank 0: each layer moves to its device while it is cut; the others stay meta
    if rank != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    del full
    with torch.no_grad():
        for buf in model.buffers():  # non-persistent buffers are in no state dict: rank 0's are the truth
            dist.broadcast(buf, src=0)
    return model, tokenizer


def gather(model: nn.Module, rank: int, *, dtype: torch.dtype | None = None,
           keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The full tensors of ``model``'s state dict on rank 0's device (empty on the other ranks), gathered one at a
    time, each cast to ``dtype`` (floating tensors) on its shard before the gather; ``keep`` selects the keys.
    Every rank calls this together (one all-gather per kept tensor, in the same order everywhere)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if keep is not None and not keep(name):
            continue
        t = value.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if rank == 0:
            out[name] = t
    return out

