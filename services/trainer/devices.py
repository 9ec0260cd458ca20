"""Where the trainer runs: the device each rank trains on, checked before anything is loaded.

A device that is not there (``cuda`` on a CPU host, ``cuda:3`` on a one-GPU host, more CUDA ranks
than GPUs) is a configuration error that names its key, raised at start-up, never a crash deep
inside torch on the first step.

**GPU defaults** (:func:`precision_defaults`): on CUDA the trainer runs as GPU trainers should by default:
``[model] dtype = "auto"`` is bfloat16 mixed precision (where the GPU has bf16), float32 matmuls use TF32
(``devices.tf32``), AdamW is the fused kernel (``optim.fused``) and the caching allocator grows segments in
place (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless set; the torch engine on CUDA too:
:mod:`services.lib.cuda_alloc`). On CPU nothing changes: float32,
full-precision matmuls, the default AdamW, no allocator setting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.lib.cuda_alloc import CUDA_ALLOC_CONF, set_alloc_conf
from services.runtime.config import ConfigError
from services.trainer.config import TrainerConfig

log = logging.getLogger("rlbus.trainer.devices")



@dataclass(frozen=True)
class Placement:
    """The resolved devices and precision of one rank."""

    #: the policy's device ("cpu" or "cuda:N")
    device: str
    #: the reference model's device
    ref_device: str
    #: torch.distributed backend of the rank group (gloo on CPU, nccl on CUDA)
    backend: str
    #: training precision (``[model] dtype`` resolved): float32, or bfloat16 mixed precision
    dtype: str = "float32"
    #: float32 matmuls in TF32 (CUDA only)
    tf32: bool = False
    #: the fused AdamW kernel (CUDA only)
    fused_optim: bool = False

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_cuda(key: str, value: str, index: int | None) -> None:
    count = _cuda_count()
    if count == 0:
        raise ConfigError(f"config key services.trainer.devices.{key} is {value!r}, but this host has no CUDA "
                          f"device (torch {torch.__version__}); use \"cpu\" or \"auto\"")
    if index is not None and index >= count:
        raise ConfigError(f"config key services.trainer.devices.{key} is {value!r}, but this host has {count} "
                          f"CUDA device(s) (cuda:0..cuda:{count - 1})")


def _index(value: str) -> int | None:
    return int(value.split(":", 1)[1]) if ":" in value else None


@dataclass(frozen=True)
class Precision:
    """What a device type gets by default (see the module docstring)."""

    #: training precision: "float32" or "bfloat16"
    dtype: str
    #: float32 matmuls in TF32
    tf32: bool
    #: the fused AdamW kernel
    fused_optim: bool
    #: ``PYTORCH_CUDA_ALLOC_CONF`` for the process ("" on CPU)
    alloc_conf: str


def precision_defaults(device_type: str, dtype: str, trainer: TrainerConfig,
                       bf16_supported: Callable[[], bool] = lambda: True) -> Precision:
    """The precision settings of a trainer on ``device_type`` ("cpu" or "cuda") for ``[model] dtype``
    ``dtype`` ("auto", "float32" or "bfloat16"); ``bf16_supported`` says whether the GPU has bf16 (asked
    only for "auto" on CUDA). Pure: nothing is applied here."""
    if device_type != "cuda":
        return Precision(dtype="float32" if dtype == "auto" else dtype, tf32=False, fused_optim=False,
                         alloc_conf="")
    if dtype == "auto":
        dtype = "bfloat16" if bf16_supported() else "float32"
    return Precision(dtype=dtype, tf32=trainer.devices.tf32, fused_optim=trainer.optim.fused,
                     alloc_conf=CUDA_ALLOC_CONF)


def apply_cuda_settings(precision: Precision) -> None:
    """Apply the process-wide settings of a CUDA trainer: the allocator's (before CUDA initialises; a value
    already in the environment is kept) and TF32 for float32 matmuls."""
    set_alloc_conf(precision.alloc_conf)
    fp32 = "tf32" if precision.tf32 else "ieee"  # torch's current API (mixing it with allow_tf32 is an error)
    torch.backends.cuda.matmul.fp32_precision = fp32
    torch.backends.cudnn.conv.fp32_precision = fp32


def resolve(trainer: TrainerConfig, rank: int = 0, dtype: str = "auto") -> Placement:
    """The devices of ``rank`` training in ``dtype`` (``[model] dtype``; "auto": :func:`precision_defaults`);
    raises ConfigError (naming the key) when the host cannot serve them. On CUDA it also applies the
    process-wide GPU defaults (:func:`apply_cuda_settings`), before CUDA initialises."""
    cfg = trainer.devices
    cfg.check()
    wanted = cfg.device
    if wanted == "auto":
        wanted = "cuda" if _cuda_count() > 0 else "cpu"
    if wanted == "cpu":
        device = "cpu"
    else:
        index = _index(wanted)
        _check_cuda("device", cfg.device, index)
        if cfg.world_size > 1:
            if index is not None:
                raise ConfigError(f"config key services.trainer.devices.device is {cfg.device!r} with world_size "
                                  f"{cfg.world_size}: each rank takes its own GPU (local rank r on cuda:r); "
                                  "set device = \"cuda\"")
            if cfg.nproc_per_node > _cuda_count():
                raise ConfigError(f"config key services.trainer.devices.world_size is {cfg.world_size} "
                                  f"({cfg.nproc_per_node} rank(s) on each of {cfg.nnodes} node(s)), but this host "
                                  f"has {_cuda_count()} CUDA device(s) (one rank per GPU)")
            device = f"cuda:{rank % cfg.nproc_per_node}"  # the node's local rank; GPUs as its placement shows them
        else:
            device = f"cuda:{index or 0}"
    ref = cfg.ref_device or device
    if ref != device and ref != "cpu":
        _check_cuda("ref_device", cfg.ref_device, _index(ref))
        if cfg.world_size > 1 and ":" in ref:
            raise ConfigError(f"config key services.trainer.devices.ref_device is {cfg.ref_device!r} with world_size "
                              f"{cfg.world_size}: every rank's reference would sit on that one GPU; set \"cuda\" "
                              "(each rank's own GPU, sharded like the policy) or \"cpu\"")
        ref = device if cfg.world_size > 1 and device.startswith("cuda") else (ref if ":" in ref else "cuda:0")
    kind = torch.device(device).type
    if kind == "cuda":  # before the first CUDA call below (the allocator reads its setting once); the
        # settings do not depend on the dtype, which needs that call to resolve
        apply_cuda_settings(precision_defaults(kind, "float32", trainer))
    precision = precision_defaults(kind, dtype, trainer, torch.cuda.is_bf16_supported)
    if precision.dtype == "bfloat16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"config key model.dtype is 'bfloat16', but {device} has no bf16 support")
    if kind == "cuda":
        log.info("rank %d on %s: %s, TF32 %s, fused AdamW %s, PYTORCH_CUDA_ALLOC_CONF=%s", rank, device,
                 precision.dtype, "on" if precision.tf32 else "off", "on" if precision.fused_optim else "off",
                 os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    return Placement(device=device, ref_device=ref, backend="nccl" if kind == "cuda" else "gloo",
                     dtype=precision.dtype, tf32=precision.tf32, fused_optim=precision.fused_optim)
