"""The layout rules of the ``vllm`` weight transport (:mod:`.vllm_transfer`), with no vLLM and no bus: which
trainer/engine GPU pairs each backend serves, the ranks of the group, and how tensors are cut into buckets."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.runtime.weights_config import ConfigError


def check_gpus(backend: str, trainer_gpu: str, engines: Mapping[str, list[str]]) -> None:
    """Refuse a layout the backend cannot serve, before any collective: ``nccl`` needs every worker on a
    GPU other than the trainer's (and the trainer on a GPU); ``ipc`` needs every worker on the trainer's;
    ``gloo`` moves host tensors and needs nothing."""
    if backend == "gloo":
        return
    if trainer_gpu == "cpu":
        raise ConfigError(f"weights.backend = {backend!r} sends from the trainer's GPU, but the trainer has none; "
                          'use [weights] type = "store" (or "broadcast" with gloo) on CPU')
    for engine, gpus in engines.items():
        if backend == "nccl" and trainer_gpu in gpus:
            raise ConfigError(f"weights.backend = 'nccl': engine {engine} has a worker on the trainer's GPU "
                              f"{trainer_gpu}; NCCL needs one GPU per rank. Give the rollout other GPUs "
                              '([placement]) or colocate with weights.backend = "ipc"')
        if backend == "ipc" and any(g != trainer_gpu for g in gpus):
            raise ConfigError(f"weights.backend = 'ipc': engine {engine} has workers on {sorted(set(gpus))}, not "
                              f"on the trainer's GPU {trainer_gpu}; CUDA IPC serves a colocated engine only "
                              '(use weights.backend = "nccl" for engines on other GPUs)')


def rank_offsets(engines: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Each engine's first rank in the group (trainer rank 0, then every engine's workers in turn, by id)
    and the group's size."""
    offsets, next_rank = {}, 1
    for engine in sorted(engines):
        offsets[engine] = next_rank
        next_rank += engines[engine]
    return offsets, next_rank


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """The tensors of each packed bucket, as vLLM's ``pack_tensors`` cuts them: tensors are added in order
    until the bucket holds more than ``bucket_bytes`` (the tensor that crosses the bound is in it)."""
    buckets: list[list[str]] = []
    names: list[str] = []
    total = 0
    for name, nbytes in sizes:
        names.append(name)
        total += nbytes
        if total > bucket_bytes:
            buckets.append(names)
            names, total = [], 0
    if names:
        buckets.append(names)
    return buckets


def device_uuid(device: torch.device | None = None) -> str:
    """The GPU UUID of ``device`` (the current CUDA device by default), or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return str(torch.cuda.get_device_properties(index).uuid)
