"""The pieces under the broadcast transport (``broadcast.py``): a private process group whose every call is
bounded by the timeout and whose communicator is aborted when one fails, and the digest computed where the data
is (sha256 on the host, a position-weighted checksum on a GPU).

Fail-fast: a join or a collective runs in a worker thread, awaited for at most ``timeout_s`` plus a little
slack. When it fails or runs over, the group's communicator is aborted (``ProcessGroup.abort()``: on NCCL this
ends the kernel spinning on a dead peer, which would otherwise hold the GPU stream, block the trainer's next
step behind it and end with the NCCL watchdog killing the process), the thread is given a bounded moment to
return, and :class:`BroadcastError` is raised: only that call fails. NCCL's own timeout (its watchdog) is set
beyond that bound, so our abort always comes first. A group that is dropped for good (closed, replaced,
re-formed) is shut down, never just forgotten: :func:`open_groups` counts the communicators alive.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import weakref
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from services.lib.weights.transport import VersionNotDelivered
from services.runtime.weights_config import BroadcastConfig, ConfigError

log = logging.getLogger("rlbus.weightsync.broadcast")

_SLACK_S = 5.0  # extra wall time over the collective's own timeout before we give up on its thread
_DIGEST_BYTES = 32
_REFORM_PAUSE_S = 1.0  # between withdrawing a failed group and forming the next
_LIVE: weakref.WeakSet[_Group] = weakref.WeakSet()  # groups whose communicator is open


class BroadcastError(VersionNotDelivered):
    """A broadcast join or transfer failed or timed out; the message says which and what to check."""


def open_groups() -> int:
    """Broadcast communicators of this process not yet aborted or shut down."""
    return sum(1 for g in list(_LIVE) if g.pg is not None)


def _backend(config: BroadcastConfig) -> str:
    if config.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return config.backend


def _device(backend: str, device: str | torch.device | None = None) -> torch.device:
    """Where this side's buffers live: the CPU for gloo; for NCCL the GPU of the trainer rank or engine that holds
    the weights (``device``), never the thread's current device (an engine on cuda:1 whose thread says cuda:0
    would share the trainer's GPU, and NCCL refuses a group with a GPU twice)."""
    if backend != "nccl":
        return torch.device("cpu")
    if device is None:
        raise ConfigError("the nccl broadcast needs the device of the weights it sends or receives (the trainer "
                          "rank's or the engine's GPU): pass device= to make_sender/make_receiver")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ConfigError(f"weights.backend is nccl but the weights live on {dev}; use backend = \"gloo\" "
                          "(or \"auto\") for CPU engines and trainers")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


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
    """A private process group of ``world_size`` ranks; every call bounded by the timeout, and the communicator
    aborted when one fails (``state`` says which end it came to)."""

    def __init__(self, config: BroadcastConfig, backend: str, world_size: int,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.backend = backend
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.timeout = timedelta(seconds=config.timeout_s)
        self.pg: dist.ProcessGroup | None = None
        self.store: dist.TCPStore | None = None
        #: "new" (no communicator yet), "open", "aborted" (a call failed) or "shut down" (closed or replaced)
        self.state: Literal["new", "open", "aborted", "shut down"] = "new"

    async def _bounded(self, what: str, fn, *args):
        call = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(call), self.config.timeout_s + _SLACK_S)
        except TimeoutError as err:
            failure = BroadcastError(
                f"broadcast {what} did not finish within {self.config.timeout_s}s; check that every engine "
                "is running and inside receive(), and that master_addr is reachable"
            )
            failure.__cause__ = err
        except RuntimeError as err:  # torch.distributed reports timeouts and peer failures as RuntimeError
            failure = BroadcastError(
                f"broadcast {what} failed: {err}; check that all {self.world_size - 1} engines are "
                "running and inside receive()"
            )
            failure.__cause__ = err
        except asyncio.CancelledError:  # the caller gave up (shutdown): the collective must not outlive it
            self.abort(f"{what} cancelled")
            raise
        self.abort(str(failure))
        await self._settle(call, what)
        raise failure

    async def _settle(self, call: asyncio.Future, what: str) -> None:
        """Give the worker thread of an aborted call a bounded moment to return (its communicator is gone)."""
        done, _ = await asyncio.wait({call}, timeout=_SLACK_S)
        if not done:
            log.error("broadcast %s: its thread is still inside torch.distributed %.0fs after the abort", what,
                      _SLACK_S)
        elif not call.cancelled():
            call.exception()  # retrieved: it is the failure already reported

    def abort(self, reason: str) -> None:
        """Abort the communicator (a failed or overdue call): what is in flight on it ends, nothing waits."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is None:
            return
        self.state = "aborted"
        log.warning("aborting broadcast communicator (%s rank group of %d): %s", self.backend, self.world_size,
                    reason)
        try:
            pg.abort()
        except RuntimeError as e:  # a communicator already torn down by its peer's failure
            log.debug("abort of the broadcast communicator: %s", e)

    def shutdown(self) -> None:
        """Release a healthy communicator (the group is closed or replaced); a failed one is aborted instead."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is None:
            return
        self.state = "shut down"
        try:
            pg.shutdown()
        except RuntimeError as e:
            log.debug("shutdown of the broadcast communicator failed (%s); aborting it", e)
            try:
                pg.abort()
            except RuntimeError as e2:
                log.debug("abort of the broadcast communicator: %s", e2)

    def _make_pg(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        size = self.world_size
        if self.backend == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise BroadcastError("backend nccl requested but this torch build has no NCCL; use gloo")
            opts = nccl.Options()
            # the watchdog's limit beyond ours: our bound fires first and aborts the communicator, so the
            # watchdog never finds a timed-out collective to kill the process over
            opts._timeout = self.timeout + timedelta(seconds=4 * _SLACK_S)
            return nccl(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, self.timeout)

    async def join(self, addr: str, port: int, group_id: str, rank: int, is_master: bool) -> None:
        def connect() -> None:
            store = dist.TCPStore(
                addr, port, self.world_size, is_master, self.timeout, wait_for_workers=False
            )
            self.store = store
            self.pg = self._make_pg(dist.PrefixStore(f"rlbus-{group_id}", store), rank)
            self.state = "open"
            _LIVE.add(self)

        await self._bounded(f"join of rank {rank} (group {group_id})", connect)

    async def bcast(self, tensor: torch.Tensor) -> None:
        pg = self.pg
        if pg is None:
            raise BroadcastError("broadcast before the group was joined (or after it failed); call start() first")

        def run() -> None:
            if tensor.is_cuda:
                with torch.cuda.device(tensor.device):  # this thread's current device: the weights' GPU
                    pg.broadcast(tensor, 0).wait(self.timeout)
                    torch.cuda.current_stream(tensor.device).synchronize()  # returns once aborted, at the latest
            else:
                pg.broadcast(tensor, 0).wait(self.timeout)

        await self._bounded(f"of {tensor.numel()} bytes", run)
