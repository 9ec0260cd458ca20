"""The rollout's engine, built from its config section (``engine = { type = "auto" | "torch" | "vllm", ... }``).

Both engines implement :class:`services.lib.engine.base.Engine`; nothing else in the rollout service
knows which one it serves with.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.lib.engine.base import Engine
from services.lib.engine.torch_config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.engine.vllm_config import VllmEngineConfig, vllm_available
from services.lib.engine.vllm_engine import VllmEngine
from services.rollout.config import AutoEngineSection, EngineSection, TorchEngineSection, VllmEngineSection
from services.tasks.models import model_params

log = logging.getLogger(__name__)


def concrete_engine(section: EngineSection, model: str) -> TorchEngineSection | VllmEngineSection:
    """``section`` itself, or for ``auto`` the engine it picks for ``model`` in this environment."""
    if not isinstance(section, AutoEngineSection):
        return section
    params = model_params(model)
    size = f"{params / 1e6:.1f} M parameters" if params is not None else "size unknown"
    if section.picks_vllm(model):
        if vllm_available():
            import torch

            log.info("engine auto: vllm for %s (%s >= %g M)", model, size, section.vllm_min_params_m)
            # on CPU without CUDA graphs or torch.compile (a slow start for no gain at these sizes)
            return VllmEngineSection(enforce_eager=not torch.cuda.is_available())
        log.warning("engine auto: torch for %s (%s): vLLM is faster for models this size but is not installed "
                    "here (./rlbus setup vllm, or pip install \"rlbus[rollout,vllm]\" on a CUDA machine)", model, size)
    else:
        log.info("engine auto: torch for %s (%s < %g M)", model, size, section.vllm_min_params_m)
    return TorchEngineSection()


def build_engine(section: EngineSection, model_dir: Path) -> Engine:
    """The engine ``section`` describes, serving the model in ``model_dir`` (not started yet)."""
    section = concrete_engine(section, str(model_dir))
    if isinstance(section, TorchEngineSection):
        return TorchEngine(TorchEngineConfig(
            model_dir=str(model_dir), dtype=section.dtype, device=section.device or None,
            max_batch_size=section.max_batch_size, num_threads=section.num_threads or None,
            weight_update_mode=section.weight_update_mode))
    if isinstance(section, VllmEngineSection):
        return VllmEngine(VllmEngineConfig(
            model_dir=str(model_dir), dtype=section.dtype, max_num_seqs=section.max_num_seqs,
            max_model_len=section.max_model_len or None, gpu_memory_utilization=section.gpu_memory_utilization,
            kv_cache_gib=section.kv_cache_gib or None, enable_prefix_caching=section.enable_prefix_caching,
            tensor_parallel_size=section.tensor_parallel_size, enforce_eager=section.enforce_eager,
            weight_update_mode=section.weight_update_mode, enable_sleep_mode=section.enable_sleep_mode,
            seed=None, engine_args=dict(section.engine_args)))  # replicas must not draw the same samples
    raise TypeError(f"unknown engine section {type(section).__name__}")
