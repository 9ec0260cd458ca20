"""How new weights reach vLLM's workers: the worker extension that loads them in place, and the checks
the engine makes first (names and shapes against the Hugging Face model, whole fused layers only).

:class:`VllmWorkerExtension` runs inside vLLM's worker processes (``worker_extension_cls``), called
through ``collective_rpc``; everything here imports vLLM lazily, inside the workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class VllmWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through ``collective_rpc``."""

    def rlbus_load_weights(self, path: str) -> int:
        """Load the tensors of the safetensors file ``path`` in place through vLLM's ``reload_weights``
        (whole layers only: a layer it reloads is rebuilt from the tensors given)."""
        from safetensors import safe_open
        from vllm.platforms import current_platform

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))
        head = getattr(self.model_runner.model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if current_platform.is_cpu() and "lm_head.weight" not in names and method is not None:
            # a tied head is not reloaded, but on CPU it keeps a packed copy of the embeddings: repack it
            method.process_weights_after_loading(head)
        return len(names)

    def rlbus_device_uuid(self) -> str:
        """This worker's GPU UUID ("cpu" when it has none): the vllm transport refuses a trainer on it."""
        import torch

        device = getattr(self, "device", None)
        if device is None or getattr(device, "type", "cpu") != "cuda":
            return "cpu"
        return str(torch.cuda.get_device_properties(device.index or 0).uuid)

    def rlbus_packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fused layers of this model and the checkpoint layers in each (e.g. qkv_proj: q, k, v)."""
        return dict(getattr(self.model_runner.model, "packed_modules_mapping", {}) or {})


def hf_parameter_shapes(model_dir: str) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Names and shapes of the Hugging Face model's state dict (built on the meta device, no weights
    read), and whether its word embeddings are tied."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, tied


def layer_groups(names: Mapping[str, Any], packed: Mapping[str, list[str]]) -> dict[str, str]:
    """Checkpoint tensor name -> the vLLM layer it is loaded into (its module, fused ones by vLLM's name)."""
    fused = {part: whole for whole, parts in packed.items() for part in parts}
    groups = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")[0].rpartition(".")
        groups[name] = f"{parent}.{fused.get(leaf, leaf)}"
    return groups
