"""Settings of the vLLM engine (no vLLM import: configs are checked where vLLM is not installed)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from services.lib.engine.base import InvalidRequestError, WeightUpdateMode


def vllm_available() -> bool:
    """Whether this interpreter can import vLLM (a real package: a stray ``vllm`` directory does not count)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


GIB = 1 << 30
#: KV cache of a CPU engine when ``kv_cache_gib`` is unset (vLLM's default takes a share of all memory)
CPU_DEFAULT_KV_CACHE_GIB = 1.0
#: typed keys that ``engine_args`` must not repeat
_TYPED_ARGS = frozenset({"model", "tokenizer", "dtype", "max_num_seqs", "max_model_len", "gpu_memory_utilization",
                         "enable_prefix_caching", "tensor_parallel_size", "enforce_eager", "seed",
                         "enable_sleep_mode", "kv_cache_memory_bytes", "logprobs_mode", "worker_extension_cls"})


@dataclass
class VllmEngineConfig:
    """Settings of the vLLM engine; ``engine_args`` passes any other vLLM engine argument through."""

    model_dir: str = ""
    """Hugging Face model directory (config, safetensors, tokenizer)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype; ``auto`` takes the checkpoint's."""
    max_num_seqs: int = 256
    """Most sequences in one engine step; further requests wait in vLLM's queue."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; ``None`` takes the model's."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory vLLM may use (weights, activations, KV cache); GPU only."""
    kv_cache_gib: float | None = None
    """KV cache GiB (``kv_cache_memory_bytes``); ``None``: from gpu_memory_utilization on GPU, 1 GiB on CPU."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (a GRPO group shares its prompt)."""
    tensor_parallel_size: int = 1
    """GPUs one model is sharded over."""
    enforce_eager: bool = False
    """Skip torch.compile and CUDA graphs (faster start, slower steps)."""
    seed: int | None = None
    """Seed of the generator of unseeded requests; ``None`` draws a fresh one (engines must not share it)."""
    weight_update_mode: WeightUpdateMode = "in_flight"
    """``in_flight``: apply between two engine steps, requests kept; ``between_requests``: once no request runs."""
    initial_version: int = 0
    """Weight version of the weights loaded at start."""
    max_queued: int = 4096
    """Most requests waiting beyond ``max_num_seqs``; past it ``generate`` raises EngineOverloadedError."""
    enable_sleep_mode: bool = False
    """Allow :meth:`VllmEngine.sleep` / :meth:`VllmEngine.wake_up` (colocation); GPU only."""
    staging_dir: str = ""
    """Where weight updates are staged for the workers (same host); empty: /dev/shm, else the temp dir."""
    stats_window_s: float = 10.0
    """Window of the tokens/s figure in :meth:`VllmEngine.stats`."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.AsyncEngineArgs`` fields, passed as given (e.g. ``{"block_size": 16}``)."""

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"vllm engine config: {key} {why}")

        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise bad("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for key in ("max_num_seqs", "tensor_parallel_size", "max_queued"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise bad("kv_cache_gib", f"must be > 0, got {self.kv_cache_gib}")
        if self.weight_update_mode not in ("in_flight", "between_requests"):
            raise bad("weight_update_mode", f"must be in_flight or between_requests, got {self.weight_update_mode!r}")
        clash = sorted(_TYPED_ARGS & set(self.engine_args))
        if clash:
            raise bad("engine_args", f"repeats {clash}: set them as typed keys (or they are set by rlbus)")
