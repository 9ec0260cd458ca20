"""A ``gloo`` backend for vLLM's weight-transfer API: the ``nccl`` backend's handshake and layerwise
reload, with the bytes on a gloo group (CPU tensors), so the ``vllm`` transport runs end to end on CPU
(the vLLM CPU build, the tests) exactly as it does on GPUs but for the collective itself.

Registered in vLLM's two factories (``WeightTransferEngineFactory`` in every worker, through the worker
extension below; ``WeightTransferTrainerFactory`` in the trainer) under ``gloo``. Tensors travel in
buckets of ``bucket_bytes`` (:func:`~services.lib.weights.vllm_transfer.plan_buckets`, the cut vLLM's
packed NCCL path makes), each one broadcast from the trainer (rank 0) and loaded by the worker's
``model.load_weights`` as it arrives. Imports vLLM: only imported where vLLM is.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from services.lib.engine.vllm_weights import VllmWorkerExtension
from services.lib.weights.vllm_layout import plan_buckets

BACKEND = "gloo"


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Worker side: where the trainer's TCPStore is, this engine's first rank, the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: the tensors in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _group(address: str, port: int, rank: int, world: int, timeout_s: float, master: bool) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world, master, timeout, wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("rlbus-vllm", store), rank, world, timeout)


def _buckets(names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors of each bucket."""
    sizes = [(str(i), torch.Size(s).numel() * d.itemsize) for i, (d, s) in enumerate(zip(dtypes, shapes, strict=True))]
    return [[int(i) for i in bucket] for bucket in plan_buckets(sizes, bucket_bytes)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side (inside every vLLM worker): receive each bucket, load its tensors in place."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.pg: dist.ProcessGroup | None = None
        self.bucket_bytes = 0
        self.timeout = timedelta(seconds=60)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config  # the rank vLLM's NCCL backend gives this worker
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.bucket_bytes, self.timeout = init_info.bucket_bytes, timedelta(seconds=init_info.timeout_s)
        self.pg = _group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                         init_info.timeout_s, master=False)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU tensors: nothing to synchronize

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.pg is None:
            raise RuntimeError("gloo weight transfer not initialised: init_weight_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        for bucket in _buckets(update_info.names, dtypes, update_info.shapes, self.bucket_bytes):
            sizes = [torch.Size(update_info.shapes[i]).numel() * dtypes[i].itemsize for i in bucket]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            self.pg.broadcast(flat, 0).wait(self.timeout)
            weights, pos = [], 0
            for i, n in zip(bucket, sizes, strict=True):
                weights.append((update_info.names[i],
                                flat[pos : pos + n].view(dtypes[i]).view(update_info.shapes[i])))
                pos += n
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        self.pg = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the rendezvous it opens (rank 0) and the wire parameters it hands the workers."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: the handshake of vLLM's NCCL trainer engine, broadcasting buckets over gloo."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, init_info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.pg: dist.ProcessGroup | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, init_info=init_info)
        worker = GlooInitInfo(master_address=init_info.master_address, master_port=init_info.master_port,
                              rank_offset=1, world_size=init_info.world_size, bucket_bytes=init_info.bucket_bytes,
                              timeout_s=init_info.timeout_s)
        # both sides meet in the rendezvous: the trainer's end waits on a thread, so that an engine that
        # refuses or does not answer fails the init at once (the thread ends at the group's own timeout)
        exe = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            group = exe.submit(_group, init_info.master_address, init_info.master_port, 0, init_info.world_size,
                               init_info.timeout_s, True)
            client.init_weight_transfer_engine(asdict(worker))
            engine.pg = group.result(init_info.timeout_s)
        finally:
            exe.shutdown(wait=False)
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        names, dtypes, shapes = [m.name for m in meta], [m.dtype for m in meta], [list(m.shape) for m in meta]
        info = GlooUpdateInfo(names=names, dtype_names=[str(d).split(".")[-1] for d in dtypes], shapes=shapes)
        tensors = dict(iter(self.source))
        timeout = timedelta(seconds=self.info.timeout_s)
        self.client.start_weight_update()
        exe = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            received = exe.submit(self.client.update_weights, asdict(info))
            for bucket in _buckets(names, dtypes, shapes, self.info.bucket_bytes):
                flat = torch.cat([tensors[names[i]].detach().contiguous().reshape(-1).view(torch.uint8).cpu()
                                  for i in bucket])
                self.pg.broadcast(flat, 0).wait(timeout)  # type: ignore[union-attr]
            received.result(self.info.timeout_s)
        finally:
            exe.shutdown(wait=False)  # a worker stuck in a failed collective must not hang the trainer
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.pg = None


class GlooWorkerExtension(VllmWorkerExtension):
    """rlbus's worker extension, in a module that registers the gloo backend in the worker's vLLM."""


for _factory, _cls in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                       (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
    if BACKEND not in _factory._registry:
        _factory.register_engine(BACKEND, _cls)
