"""The pieces under the broadcast transport (``broadcast.py``): a private process group whose every call is
bounded by the timeout, and the digest computed where the data is (sha256 on the host, a position-weighted
checksum on a GPU)."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta

import torch
import torch.distributed as dist

from services.runtime.weights_config import BroadcastConfig

_SLACK_S = 5.0  # extra wall time over the collective's own timeout before we give up on its thread
_DIGEST_BYTES = 32
_REFORM_PAUSE_S = 1.0  # between withdrawing a failed group and forming the next


class BroadcastError(RuntimeError):
    """A broadcast join or transfer failed or timed out; the message says which and what to check."""


def _backend(config: BroadcastConfig) -> str:
    if config.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return config.backend


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class DeviceDigest:
    """A checksum of a byte stream computed on the device that holds it (never ``.numpy()``): Fletcher-style
    ``s1 = sum(b_i)``, ``s2 = sum((i + 1) * b_i)`` mod 2**64 over bytes ``b_i`` at stream position ``i``, and
    the length. Integer sums are exact and order-free (CUDA and CPU, any bucket cuts: the same digest); a
    changed byte changes ``s1``, moved bytes ``s2``. Against corruption and layout mistakes, not tampering."""

    _CHUNK = 1 << 24  # bytes widened to int64 at a time (128 MiB of scratch on the device)
    _MASK = (1 << 64) - 1

    def __init__(self) -> None:
        self.s1 = 0
        self.s2 = 0
        self.length = 0

    def update(self, data: torch.Tensor) -> None:
        flat = data.reshape(-1)
        if flat.dtype != torch.uint8:
            raise TypeError(f"DeviceDigest takes uint8 bytes, got {flat.dtype}")
        for lo in range(0, flat.numel(), self._CHUNK):
            chunk = flat[lo : lo + self._CHUNK].to(torch.int64)
            weights = torch.arange(self.length + 1, self.length + 1 + chunk.numel(), dtype=torch.int64,
                                   device=chunk.device)
            self.s1 = (self.s1 + int(chunk.sum())) & self._MASK
            self.s2 = (self.s2 + int((chunk * weights).sum())) & self._MASK
            self.length += chunk.numel()

    def digest(self) -> bytes:
        return b"rlbusdev" + b"".join(n.to_bytes(8, "little") for n in (self.s1, self.s2, self.length))

    def hexdigest(self) -> str:
        return self.digest().hex()


def _hasher(device: torch.device) -> DeviceDigest | hashlib._Hash:
    """The digest of buckets on ``device``: sha256 of host bytes, or a DeviceDigest on a GPU."""
    return DeviceDigest() if device.type == "cuda" else hashlib.sha256()


def _hash_update(h: DeviceDigest | hashlib._Hash, view: torch.Tensor) -> None:
    if isinstance(h, DeviceDigest):
        h.update(view)
    else:
        h.update(view.numpy())


class _Group:
    """A private process group of ``world_size`` ranks; every call bounded by the timeout."""

    def __init__(self, config: BroadcastConfig, backend: str, world_size: int) -> None:
        self.config = config
        self.backend = backend
        self.world_size = world_size
        self.timeout = timedelta(seconds=config.timeout_s)
        self.pg: dist.ProcessGroup | None = None
        self.store: dist.TCPStore | None = None

    async def _bounded(self, what: str, fn, *args):
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.config.timeout_s + _SLACK_S)
        except TimeoutError as err:
            raise BroadcastError(
                f"broadcast {what} did not finish within {self.config.timeout_s}s; check that every engine "
                "is running and inside receive(), and that master_addr is reachable"
            ) from err
        except RuntimeError as err:  # torch.distributed reports timeouts and peer failures as RuntimeError
            raise BroadcastError(
                f"broadcast {what} failed: {err}; check that all {self.world_size - 1} engines are "
                "running and inside receive()"
            ) from err

    def _make_pg(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        size = self.world_size
        if self.backend == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise BroadcastError("backend nccl requested but this torch build has no NCCL; use gloo")
            opts = nccl.Options()
            opts._timeout = self.timeout
            return nccl(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, self.timeout)

    async def join(self, addr: str, port: int, group_id: str, rank: int, is_master: bool) -> None:
        def connect() -> None:
            store = dist.TCPStore(
                addr, port, self.world_size, is_master, self.timeout, wait_for_workers=False
            )
            self.store = store
            self.pg = self._make_pg(dist.PrefixStore(f"rlbus-{group_id}", store), rank)

        await self._bounded(f"join of rank {rank} (group {group_id})", connect)

    async def bcast(self, tensor: torch.Tensor) -> None:
        pg = self.pg
        if pg is None:
            raise BroadcastError("broadcast before the group was joined; call start() first")

        def run() -> None:
            pg.broadcast(tensor, 0).wait(self.timeout)
            if tensor.is_cuda:
                torch.cuda.current_stream().synchronize()

        await self._bounded(f"of {tensor.numel()} bytes", run)
