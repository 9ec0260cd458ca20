"""Where the trainer runs: the device each rank trains on, checked before anything is loaded.

A device that is not there (``cuda`` on a CPU host, ``cuda:3`` on a one-GPU host, more CUDA ranks
than GPUs) is a configuration error that names its key, raised at start-up, never a crash deep
inside torch on the first step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.config import ConfigError
from services.trainer.config import TrainerConfig


@dataclass(frozen=True)
class Placement:
    """The resolved devices and precision of one rank."""

    #: the policy's device ("cpu" or "cuda:N")
    device: str
    #: the reference model's device
    ref_device: str
    #: torch.distributed backend of the rank group (gloo on CPU, nccl on CUDA)
    backend: str
    #: training precision (``[model] dtype``): float32, or bfloat16 mixed precision
    dtype: str = "float32"

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


def resolve(trainer: TrainerConfig, rank: int = 0, dtype: str = "float32") -> Placement:
    """The devices of ``rank`` training in ``dtype`` (``[model] dtype``); raises ConfigError (naming the key)
    when the host cannot serve them."""
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
    if dtype == "bfloat16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"config key model.dtype is 'bfloat16', but {device} has no bf16 support")
    return Placement(device=device, ref_device=ref, backend="nccl" if device.startswith("cuda") else "gloo",
                     dtype=dtype)
