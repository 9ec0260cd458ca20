"""Settings of the ``torch`` inference engine, checked when built.

Kept apart from :mod:`services.lib.engine.torch_engine` (the decode loop and its batch) so that everything
one can set on the engine, with its meaning and its limits, reads in one short file; the rollout service,
the judge's torch backend and the benchmarks build a :class:`TorchEngineConfig` and hand it to
:class:`~services.lib.engine.torch_engine.TorchEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.lib.engine.base import InvalidRequestError, WeightUpdateMode

#: the dtype names :attr:`TorchEngineConfig.dtype` accepts, and the torch dtypes they load the model in
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TorchEngineConfig:
    """Settings of the torch engine."""

    model_dir: str = ""
    """Hugging Face model directory (config, safetensors, tokenizer); unused with ``TorchEngine.from_model``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Model weights and activations dtype; sampling always runs in float32."""
    device: str | None = None
    """torch device; ``None`` picks ``cuda`` when available, else ``cpu``."""
    max_batch_size: int = 64
    """Most rows in the running batch; more requests wait in the queue."""
    max_queued: int = 4096
    """Most queued (not yet running) requests; beyond it ``generate`` raises EngineOverloadedError."""
    max_prefill_tokens: int = 16384
    """Most padded prompt tokens prefilled in one step (at least one request is always admitted)."""
    num_threads: int | None = None
    """``torch.set_num_threads`` at start (process-wide); ``None`` leaves torch's default."""
    weight_update_mode: WeightUpdateMode = "in_flight"
    """``in_flight``: apply between decode steps; ``between_requests``: once no request runs."""
    initial_version: int = 0
    """Weight version of the weights loaded at start."""
    attn_implementation: str = "sdpa"
    """transformers attention backend (``sdpa`` or ``eager``)."""
    stats_window_s: float = 10.0
    """Window of the tokens/s figure in :meth:`TorchEngine.stats`."""
    seed: int | None = None
    """Seed of the generator shared by unseeded requests; ``None`` draws a fresh one (engines must
    not share it, or their samples would be correlated)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_batch_size", "max_queued", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequestError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.weight_update_mode not in ("in_flight", "between_requests"):
            raise InvalidRequestError(
                f"weight_update_mode must be 'in_flight' or 'between_requests', got {self.weight_update_mode!r}"
            )

