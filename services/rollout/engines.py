"""The rollout's engine, built from its config section (``engine = { type = "auto" | "torch" | "vllm", ... }``).

Both engines implement :class:`services.lib.engine.base.Engine` and take their section
(:mod:`services.lib.engine.config`) as it was read; nothing else in the rollout service knows which one it
serves with.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.lib.engine.base import Engine
from services.lib.engine.config import (
    AutoEngineConfig,
    EngineConfig,
    TorchEngineConfig,
    VllmEngineConfig,
    vllm_available,
)
from services.lib.engine.torch_engine import TorchEngine
from services.lib.engine.vllm_engine import VllmEngine
from services.tasks.models import model_params

log = logging.getLogger(__name__)


def concrete_engine(config: EngineConfig, model: str) -> TorchEngineConfig | VllmEngineConfig:
    """``config`` itself, or for ``auto`` the engine it picks for ``model`` in this environment."""
    if not isinstance(config, AutoEngineConfig):
        return config
    params = model_params(model)
    size = f"{params / 1e6:.1f} M parameters" if params is not None else "size unknown"
    if config.picks_vllm(params):
        if vllm_available():
            import torch

            log.info("engine auto: vllm for %s (%s >= %g M)", model, size, config.vllm_min_params_m)
            # on CPU without CUDA graphs or torch.compile (a slow start for no gain at these sizes)
            return VllmEngineConfig(enforce_eager=not torch.cuda.is_available())
        log.warning("engine auto: torch for %s (%s): vLLM is faster for models this size but is not installed "
                    "here (./rlbus setup vllm, or pip install \"rlbus[rollout,vllm]\" on a CUDA machine)", model, size)
    else:
        log.info("engine auto: torch for %s (%s < %g M)", model, size, config.vllm_min_params_m)
    return TorchEngineConfig()


def build_engine(config: EngineConfig, model_dir: Path) -> Engine:
    """The engine ``config`` describes, serving the model in ``model_dir`` (not started yet); its sampling
    seed is fresh (replicas must not draw the same samples)."""
    config = concrete_engine(config, str(model_dir))
    if isinstance(config, TorchEngineConfig):
        return TorchEngine(config, model_dir)
    return VllmEngine(config, model_dir)
