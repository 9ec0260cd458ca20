"""The inference engine's settings: one type, read from the run file and handed to the engines as is.

``engine = { type = "auto" | "torch" | "vllm", ... }`` in ``[services.rollout]`` decodes into
:data:`EngineConfig`; :class:`~services.lib.engine.torch_engine.TorchEngine` takes a
:class:`TorchEngineConfig` and :class:`~services.lib.engine.vllm_engine.VllmEngine` a
:class:`VllmEngineConfig` (the judge's engine backends and the benchmarks build them the same way). What is
not a setting but a fact of the run (the model directory, the seed) is an argument of the engine.

msgspec checks the limits when a run file is decoded; a config built in code is checked the same way when
made (``__post_init__``), and either raises :class:`~services.lib.engine.base.InvalidRequestError` naming
the key (inside a ``msgspec.ValidationError`` when decoding). No torch or vLLM import here.
"""

from __future__ import annotations

import importlib.util
import typing
from functools import cache
from typing import Annotated, Any, Literal

import msgspec

from services.lib.engine.base import InvalidRequestError, WeightUpdateMode

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0.0)]

#: keys that ``VllmEngineConfig.engine_args`` must not repeat (typed keys, or set by rlbus)
VLLM_TYPED_ARGS = frozenset({"model", "tokenizer", "dtype", "max_num_seqs", "max_model_len", "gpu_memory_utilization",
                             "enable_prefix_caching", "tensor_parallel_size", "enforce_eager", "seed",
                             "enable_sleep_mode", "kv_cache_memory_bytes", "logprobs_mode", "worker_extension_cls"})


def vllm_available() -> bool:
    """Whether this interpreter can import vLLM (a real package: a stray ``vllm`` directory does not count)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _check_limits(config: msgspec.Struct, label: str) -> None:
    """Every field against its annotated type and limits (msgspec checks them only when decoding)."""
    for name, annotation in _field_types(type(config)).items():
        try:
            msgspec.convert(getattr(config, name), annotation)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"{label} engine config: {name}: {exc}") from None


class TorchEngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="torch"):
    """The transformers engine with continuous batching (CPU or GPU)."""

    #: dtype of the model's weights and activations (sampling always runs in float32)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: torch device; empty picks cuda when available, else cpu
    device: str = ""
    #: most sequences decoded together; more requests wait in the queue
    max_batch_size: Pos = 128
    #: most queued (not yet running) requests; beyond it a request fails with EngineOverloadedError
    max_queued: Pos = 4096
    #: most padded prompt tokens prefilled in one step (at least one request is always admitted)
    max_prefill_tokens: Pos = 16384
    #: torch intra-op threads, set at start for the whole process (0: torch's default)
    num_threads: NonNeg = 0
    #: apply new weights between decode steps (in_flight) or only when no request runs
    weight_update_mode: WeightUpdateMode = "in_flight"
    #: release the KV cache (on a GPU also the weights) while a colocated trainer ("trainer+rollout") steps
    enable_sleep_mode: bool = False
    #: transformers attention backend ("sdpa" or "eager")
    attn_implementation: str = "sdpa"
    #: seconds of the window the engine's tokens/s figure is measured over
    stats_window_s: Seconds = 10.0

    def __post_init__(self) -> None:
        _check_limits(self, "torch")


class VllmEngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="vllm"):
    """vLLM's async engine (``services/lib/engine/vllm_engine.py``): what GPU fleets generate with.

    Needs vLLM in the rollout's environment: ``pip install "rlbus[rollout,vllm]"`` on a CUDA machine, or
    ``./rlbus setup vllm`` here (the CPU build in ``.venv-vllm``, which the launcher then runs the rollout in).
    """

    #: dtype of weights and activations ("auto": the checkpoint's)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: most sequences in one engine step (further requests queue inside vLLM)
    max_num_seqs: Pos = 256
    #: most requests waiting beyond max_num_seqs; past it a request fails with EngineOverloadedError
    max_queued: Pos = 4096
    #: longest prompt + completion in tokens (0: the model's own; else at least 2)
    max_model_len: NonNeg = 0
    #: share of GPU memory vLLM may take (weights, activations, KV cache); GPU only
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    #: KV cache size in GiB (0: from gpu_memory_utilization on GPUs, 1 GiB on CPU)
    kv_cache_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: reuse KV blocks of shared prompt prefixes (a GRPO group shares its prompt); reset on every weight update
    enable_prefix_caching: bool = True
    #: GPUs one model is sharded over
    tensor_parallel_size: Pos = 1
    #: no torch.compile / CUDA graphs (faster start, slower steps)
    enforce_eager: bool = False
    #: apply new weights between engine steps (in_flight) or only when no request runs
    weight_update_mode: WeightUpdateMode = "in_flight"
    #: release KV cache and weights while a colocated trainer ("trainer+rollout") steps; GPU only (vLLM on
    #: CPU has no sleep mode: start-up stops with an error saying so)
    enable_sleep_mode: bool = False
    #: how deep the engine sleeps while a colocated trainer steps: 1 offloads its weights to the host, 2 drops
    #: them (no host copy, no copy back) and serves again once the next update has loaded: only where every
    #: trainer step is followed by a full update (colocated, the inproc transport, no LoRA)
    sleep_level: Literal[1, 2] = 1
    #: where weight updates are staged for vLLM's workers (same host); empty: /dev/shm, else the temp dir. Needs
    #: room for one full update (the model's bytes in its dtype): checked before each write
    staging_dir: str = ""
    #: seconds of the window the engine's tokens/s figure is measured over
    stats_window_s: Seconds = 10.0
    #: further vLLM engine arguments, passed through as given (e.g. { block_size = 16 })
    engine_args: dict[str, int | float | str | bool] = {}

    def __post_init__(self) -> None:
        _check_limits(self, "vllm")
        if self.max_model_len == 1:
            raise InvalidRequestError("vllm engine config: max_model_len must be 0 (the model's) or >= 2, got 1")
        clash = sorted(VLLM_TYPED_ARGS & set(self.engine_args))
        if clash:
            raise InvalidRequestError(
                f"vllm engine config: engine_args repeats {clash}: set them as typed keys (or they are set by rlbus)")


class AutoEngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="auto"):
    """The default: the faster engine for the model, by measurement (BENCHMARKS.md, "vLLM beside the torch
    engine"): vLLM with its defaults for models of at least ``vllm_min_params_m`` million parameters when
    the rollout's environment has vLLM (the launcher runs it in ``.venv-vllm`` when that exists), else the
    torch engine with its defaults. Name ``type = "torch"`` or ``"vllm"`` to choose and tune one."""

    #: smallest model (millions of parameters) served by vLLM; below it the torch engine is faster here
    vllm_min_params_m: Annotated[float, msgspec.Meta(ge=0.0)] = 50.0

    def __post_init__(self) -> None:
        _check_limits(self, "auto")

    def picks_vllm(self, params: int | None) -> bool:
        """Whether a model of ``params`` parameters (``services.tasks.models.model_params``; ``None``:
        unknown) is served with vLLM where vLLM is installed."""
        return params is not None and params >= self.vllm_min_params_m * 1e6


#: the engine section of the run file, chosen by ``type``
EngineConfig = TorchEngineConfig | VllmEngineConfig | AutoEngineConfig
