"""The rollout's engine, built from its config section (``engine = { type = "torch" | "vllm", ... }``).

Both engines implement :class:`services.lib.engine.base.Engine`; nothing else in the rollout service
knows which one it serves with.
"""

from __future__ import annotations

from pathlib import Path

from services.lib.engine.base import Engine
from services.lib.engine.torch_config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.engine.vllm_config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine
from services.rollout.config import EngineSection, TorchEngineSection, VllmEngineSection


def build_engine(section: EngineSection, model_dir: Path) -> Engine:
    """The engine ``section`` describes, serving the model in ``model_dir`` (not started yet)."""
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
