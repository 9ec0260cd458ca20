"""Direct transport: a torch.distributed broadcast from the trainer (rank 0) to engines on the same fabric.

Rendezvous goes over the bus (``proto/weights.py``): the sender opens a
TCPStore, records a :class:`BroadcastGroup` in the scope's KV bucket and waits
for ``world_size - 1`` engines; each engine reads it, claims a rank with an
atomic KV create and joins. The process group is private to this transport
(it never touches torch.distributed's default group, which the trainer may
use for its own ranks).

Per version the sender records a :class:`BroadcastReady` (layout, size) in KV
and on the subject, then broadcasts the data section of the full layout in
``bucket_bytes`` buckets (a bounded staging buffer on the sender; receivers
write straight into their destination buffer), then a 32-byte digest of the data, which
both sides compute bucket by bucket while the next bucket is on the wire. Gloo carries CPU
tensors; NCCL carries CUDA tensors (``backend="auto"`` picks NCCL when CUDA is
available). The digest is computed where the bucket is: sha256 on the host for gloo; for NCCL
a position-weighted checksum computed on the GPU (:class:`DeviceDigest`), because sha256 would
need every byte copied to the host, the very copy a GPU-to-GPU transfer exists to avoid. Every join and
collective is bounded by ``timeout_s`` and fails with :class:`BroadcastError` — never a silent hang — after
aborting its communicator (``broadcast_group.py``: on NCCL that ends the kernel stuck on a dead peer before
the watchdog would kill the process). A dropped group is shut down, never just forgotten. The buffers live on
the ``device`` each side is given (NCCL: the trainer rank's GPU, the engine's GPU). Receivers must be inside
``receive()`` when a version is sent (iterate in a task of their own).

Recovery lives here, not in the callers: a failed ``start``/``send`` withdraws
the group, forms a new one (engines that died rejoin when they restart) and
tries again for up to ``reform_for_s``, then raises (a :class:`~services.lib.weights.transport.VersionNotDelivered`:
only that version fails, the trainer goes on); a receiver iterated with ``async for``
leaves a broken or replaced group and joins the new one.

The group follows the fleet: ``world_size`` is the fleet the first group waits
for; an engine that finds every rank taken claims the next rank beyond the
group's size (rank key ``<run>.bcast.<group>.rank.<n>``, n >= world size: a
join request, under the permission engines have anyway) and retries. At its
next send the sender counts those, withdraws the group and forms one with a
rank for each (the engines of the old group notice the replacement and rejoin).
A group that fails to form (an engine died) is formed again at the configured
size; engines beyond it ask again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import torch
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from proto import catalog
from proto.codec import decode, encode
from proto.subjects import check_run_id
from proto.weights import (
    BroadcastGroup,
    BroadcastReady,
    broadcast_group_key,
    broadcast_rank_key,
    broadcast_ready_key,
)
from services.lib.weights.blobs import WeightIntegrityError
from services.lib.weights.broadcast_group import (  # noqa: F401  (DeviceDigest, _hasher, open_groups: re-exported)
    _DIGEST_BYTES,
    _REFORM_PAUSE_S,
    BroadcastError,
    DeviceDigest,
    _backend,
    _device,
    _Group,
    _hash_update,
    _hasher,
    _raw,
    open_groups,
)
from services.lib.weights.client import cast_for_publish
from services.lib.weights.encoding import layout, torch_dtype
from services.lib.weights.index import VersionIndex, stop_watch
from services.lib.weights.transport import Weights, follow
from services.runtime import tracing
from services.runtime.natsd import free_port
from services.runtime.tasks import cancel_and_wait
from services.runtime.weights_config import BroadcastConfig, ConfigError

log = logging.getLogger("rlbus.weightsync.broadcast")

class BroadcastSender:
    """:class:`~services.lib.weights.transport.WeightSender` as rank 0 of a broadcast group."""

    def __init__(self, config: BroadcastConfig, nc: NATS, run_id: str,
                 device: str | torch.device | None = None) -> None:
        self.config = config
        self.nc = nc
        self.run_id = run_id
        self.index = VersionIndex(nc, run_id, config.scope)
        self.backend = _backend(config)
        self.device = _device(self.backend, device)  # where the buckets are staged (NCCL: the trainer's GPU)
        #: ranks of the group formed next (trainer + engines): grows with join requests, back to
        #: ``config.world_size`` after a failure
        if config.world_size < 2:
            raise ConfigError(f"weights.world_size is {config.world_size}: the broadcast group needs the trainer and "
                              "at least one engine (rlbus run/up set it from the rollouts they start; set it to "
                              "1 + engines where no launcher starts the run)")
        self.world_size = config.world_size
        self.group = _Group(config, self.backend, self.world_size, self.device)
        self.group_id = uuid.uuid4().hex[:16]
        self._grow_by = 0  # ranks the next group adds for engines that asked

    async def start(self) -> None:
        """Form the group (bounded wait until every engine joined); re-formed on failure for up to
        ``reform_for_s``."""
        await self._reforming("forming the broadcast group", None)

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Broadcast ``version`` to every engine; a failure re-forms the group and sends again."""
        await self._reforming(f"sending version {version}", lambda: self._send(state_dict, version))

    async def latest(self) -> Weights | None:
        """None: a broadcast keeps nothing (a restarted trainer continues from its checkpoint)."""
        return None

    async def _reforming(self, what: str, action: Callable[[], Awaitable[None]] | None) -> None:
        deadline = time.monotonic() + self.config.reform_for_s
        while True:
            try:
                if self.group.pg is not None and action is not None:
                    asked = await self._join_requests()
                    if asked:
                        log.info("%d engine(s) asked to join broadcast group %s; forming a larger one", asked,
                                 self.group_id)
                        await self._withdraw(requests=asked)  # its engines see it replaced and join the next
                        self._grow_by = asked
                if self.group.pg is None:
                    await self._form()
                if action is not None:
                    await action()
                return
            except BroadcastError as err:
                await self._withdraw()
                self.world_size, self._grow_by = self.config.world_size, 0  # engines beyond it ask again
                if time.monotonic() + _REFORM_PAUSE_S > deadline:
                    raise
                log.warning("%s failed (%s); re-forming the broadcast group", what, err)
                await asyncio.sleep(_REFORM_PAUSE_S)  # engines notice the new group and leave the old one

    async def _form(self) -> None:
        """Open the TCPStore, announce the group, wait (bounded) until every engine joined."""
        await self.index.ensure()
        kv = await self.index.kv()
        # a rank for every engine that asked (one that died meanwhile makes this form time out, and shrink)
        self.world_size, self._grow_by = self.world_size + self._grow_by, 0
        self.group = _Group(self.config, self.backend, self.world_size, self.device)
        port = self.config.master_port or free_port(self.config.master_addr)
        info = BroadcastGroup(
            run_id=self.run_id,
            group_id=self.group_id,
            master_addr=self.config.master_addr,
            master_port=port,
            world_size=self.world_size,
            backend=self.backend,
        )
        await kv.put(broadcast_group_key(self.run_id), encode(info))
        log.info(
            "broadcast group %s waiting for %d engines on %s:%d",
            self.group_id,
            self.world_size - 1,
            self.config.master_addr,
            port,
        )
        await self.group.join(self.config.master_addr, port, self.group_id, 0, is_master=True)

    async def _send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        sd = (
            cast_for_publish(state_dict, self.config.dtype)
            if self.config.dtype == "bf16"
            else dict(state_dict)
        )
        entries, nbytes = layout(sd)
        device = self.device
        # the digest of the data, computed bucket by bucket (on the bucket's device) while each is on the wire
        h = _hasher(device)
        ready = BroadcastReady(
            run_id=self.run_id,
            policy_version=version,
            group_id=self.group_id,
            bucket_bytes=self.config.bucket_bytes,
            tensors=entries,
            data_nbytes=nbytes,
            traceparent=tracing.traceparent(),
        )
        data = encode(ready)
        kv = await self.index.kv()
        await kv.put(broadcast_ready_key(self.run_id), data)
        await self.nc.publish(catalog.WEIGHT_BROADCASTS.subject(self.run_id, self.config.scope), data)
        await self.nc.flush()

        async def flush(view: torch.Tensor) -> None:
            await asyncio.gather(self.group.bcast(view), asyncio.to_thread(_hash_update, h, view))

        # pack tensors into a bounded bucket, broadcast it whenever it fills
        bucket = torch.empty(min(self.config.bucket_bytes, max(nbytes, 1)), dtype=torch.uint8, device=device)
        fill = 0
        for e in entries:
            src = _raw(sd[e.name])
            pos = 0
            while pos < e.nbytes:
                n = min(e.nbytes - pos, bucket.numel() - fill)
                bucket[fill : fill + n].copy_(src[pos : pos + n])
                fill += n
                pos += n
                if fill == bucket.numel():
                    await flush(bucket)
                    fill = 0
        if fill:
            await flush(bucket[:fill])
        trailer = torch.zeros(_DIGEST_BYTES, dtype=torch.uint8, device=device)
        trailer.copy_(torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8))
        await self.group.bcast(trailer)
        log.info("broadcast v%d: %d bytes to %d engines", version, nbytes, self.world_size - 1)

    async def _withdraw(self, requests: int = 0) -> None:
        """Take the group off the bus and drop it (with ``requests`` join requests beyond its ranks); the next
        one gets a new id (engines rejoin that)."""
        try:
            await self.close(requests)
        except Exception as e:  # the bus may be away too: the next group's announcement replaces this one
            log.debug("withdrawing broadcast group %s: %s", self.group_id, e)
        self.group = _Group(self.config, self.backend, self.world_size, self.device)
        self.group_id = uuid.uuid4().hex[:16]

    async def _join_requests(self) -> int:
        """Engines that asked to join: rank keys of the current group beyond its size (the stream's subject
        list, one API call, no consumer)."""
        await self.index.ensure()
        keys = f"$KV.{self.index.bucket}.{check_run_id(self.run_id)}.bcast.{self.group_id}.rank."
        info = await self.index.js.stream_info(f"KV_{self.index.bucket}", subjects_filter=f"{keys}*")
        ranks = [int(subject[len(keys):]) for subject in (info.state.subjects or {})]
        return sum(r >= self.group.world_size for r in ranks)

    async def close(self, requests: int = 0) -> None:
        """Withdraw the group from the bus and release its communicator (shut down; a failed one was aborted)."""
        self.group.shutdown()
        kv = await self.index.kv()
        await kv.purge(broadcast_group_key(self.run_id))
        for rank in range(1, self.group.world_size + requests):
            await kv.purge(broadcast_rank_key(self.run_id, self.group_id, rank))


class BroadcastReceiver:
    """:class:`~services.lib.weights.transport.WeightReceiver` as one engine rank of a broadcast group."""

    def __init__(self, config: BroadcastConfig, nc: NATS, run_id: str,
                 device: str | torch.device | None = None) -> None:
        self.config = config
        self.run_id = run_id
        self.index = VersionIndex(nc, run_id, config.scope)
        #: the engine's device (NCCL receives into it); for gloo the CPU
        self.device = device
        _device(_backend(config), device)  # NCCL without the engine's device: refused now, at the engine's start
        self.group: _Group | None = None
        self.group_info: BroadcastGroup | None = None
        self.rank: int | None = None
        self._version: int | None = None
        #: the newest version of the group joined now: each group's versions are taken whatever was held
        #: before (a re-formed group re-sends a version, a restarted trainer may start a new timeline)
        self._group_version: int | None = None
        self._ready: AsyncIterator[BroadcastReady] | None = None
        self._next_ready: asyncio.Task | None = None  # survives receive() calls (an anext() in flight)
        self._replaced = asyncio.Event()  # the trainer announced another group
        self._group_watch: asyncio.Task | None = None
        self.refused = 0
        self.last_error = ""
        self.traces: dict[int, str] = {}  # per version, the sender's traceparent (the latest few)
        self.digests: dict[int, str] = {}  # per version, the sha256 its data was verified against
        self._asked_in: str | None = None  # the full group this engine asked to join (asks once per group)

    @property
    def version(self) -> int | None:
        return self._version

    def __aiter__(self) -> AsyncIterator[Weights]:
        """Each version broadcast; a broken or replaced group is left (``close``) and the next one joined."""
        return follow(self, self.close)

    async def _first(self, key: str, typ: type, after: int = 0) -> AsyncIterator:
        """Values of ``key``: the current one, then each update (revisions up to ``after`` skipped)."""
        kv = await self.index.kv()
        watcher = await kv.watch(key, ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is not None and entry.value and (entry.revision or 0) > after:
                    yield decode(entry.value, typ, max_bytes=None)
        finally:
            await stop_watch(watcher)

    async def _revision(self, key: str) -> int:
        kv = await self.index.kv()
        try:
            return (await kv.get(key)).revision or 0
        except KeyNotFoundError:
            return 0

    async def start(self) -> None:
        """Find the group on the bus, claim a rank, join (bounded by the timeout)."""
        await self.index.ensure()
        self.rank, self._group_version, self._replaced = None, None, asyncio.Event()
        groups = self._first(broadcast_group_key(self.run_id), BroadcastGroup)
        try:
            info = await asyncio.wait_for(anext(groups), self.config.timeout_s)
        except TimeoutError as err:
            raise BroadcastError(
                f"no broadcast group announced for run {self.run_id} within {self.config.timeout_s}s; "
                "is the trainer's broadcast sender started?"
            ) from err
        finally:
            await groups.aclose()
        device = _device(info.backend, self.device)  # before claiming a rank: a refusal leaves the group whole
        kv = await self.index.kv()
        for rank in range(1, info.world_size):
            try:
                await kv.create(broadcast_rank_key(self.run_id, info.group_id, rank), b"1")
            except KeyWrongLastSequenceError:
                continue
            self.rank = rank
            break
        if self.rank is None:
            if self._asked_in != info.group_id:  # claim the first free rank beyond the group: a join request
                for extra in range(info.world_size, info.world_size + 4096):
                    try:
                        await kv.create(broadcast_rank_key(self.run_id, info.group_id, extra), b"1")
                    except KeyWrongLastSequenceError:
                        continue
                    self._asked_in = info.group_id
                    break
            raise BroadcastError(f"broadcast group {info.group_id} already has {info.world_size - 1} engines; "
                                 "asked the trainer for a rank (it forms a larger group at its next send)")
        if await self._current_group_id() != info.group_id:  # withdrawn while we claimed a rank
            raise BroadcastError(f"broadcast group {info.group_id} was withdrawn; join the next one")
        self.group_info = info
        self.group = _Group(self.config, info.backend, info.world_size, device)
        # a version of this group announced before we joined is stale (a send that failed before we came):
        # the sender announces only once every rank joined
        ready_key = broadcast_ready_key(self.run_id)
        self._ready = self._first(ready_key, BroadcastReady, after=await self._revision(ready_key))
        self._group_watch = asyncio.create_task(self._watch_group(info.group_id), name="broadcast-group-watch")
        await self.group.join(info.master_addr, info.master_port, info.group_id, self.rank, is_master=False)
        log.info("joined broadcast group %s as rank %d", info.group_id, self.rank)

    async def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        if self.group is None or self._ready is None or self.group_info is None:
            await self.start()
        group, ready_iter, info = self.group, self._ready, self.group_info
        if group is None or ready_iter is None or info is None:
            raise BroadcastError("broadcast receiver failed to start")
        while True:
            ready = await self._next_announcement(ready_iter, info.group_id)
            if ready.group_id != info.group_id:
                if await self._current_group_id() != info.group_id:
                    raise BroadcastError(
                        f"the trainer replaced broadcast group {info.group_id}; restart this receiver to rejoin"
                    )
                continue  # a stale announcement of an older group
            if self._group_version is None or ready.policy_version > self._group_version:
                break
        flat = torch.empty(ready.data_nbytes, dtype=torch.uint8, device=group.device)
        h = _hasher(flat.device)
        hashing = None  # hash bucket i while bucket i + 1 arrives
        for off in range(0, ready.data_nbytes, ready.bucket_bytes):
            view = flat[off : off + ready.bucket_bytes]
            if hashing is None:
                await group.bcast(view)
            else:
                await asyncio.gather(group.bcast(view), hashing)
            hashing = asyncio.to_thread(_hash_update, h, view)
        if hashing is not None:
            await hashing
        trailer = torch.empty(_DIGEST_BYTES, dtype=torch.uint8, device=flat.device)
        await group.bcast(trailer)
        expected = bytes(trailer.cpu().numpy())
        if any(expected) and h.digest() != expected:
            raise WeightIntegrityError(
                f"broadcast v{ready.policy_version} arrived with sha256 {h.hexdigest()}, expected {expected.hex()}; "
                "refused, keep the current weights",
                version=ready.policy_version,
            )
        tensors = {
            e.name: flat[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)
            for e in ready.tensors
        }
        self._version = self._group_version = ready.policy_version
        self.digests = {v: d for v, d in self.digests.items() if v > ready.policy_version - 8}
        self.digests[ready.policy_version] = f"sha256:{expected.hex()}" if any(expected) else ""
        if ready.traceparent:
            self.traces = {v: t for v, t in self.traces.items() if v > ready.policy_version - 8}
            self.traces[ready.policy_version] = ready.traceparent
        return ready.policy_version, tensors

    async def _watch_group(self, group_id: str) -> None:
        """Set ``_replaced`` when the trainer announces a different group (it restarted or re-formed it)."""
        groups = self._first(broadcast_group_key(self.run_id), BroadcastGroup)
        try:
            async for info in groups:
                if info.group_id != group_id:
                    self._replaced.set()
                    return
        finally:
            await groups.aclose()

    async def _next_announcement(self, ready_iter: AsyncIterator[BroadcastReady], group_id: str) -> BroadcastReady:
        """The next BroadcastReady, or BroadcastError as soon as the group is replaced (so the engine
        rejoins instead of waiting for announcements that will never come to its old group)."""
        if self._next_ready is None:
            self._next_ready = asyncio.ensure_future(anext(ready_iter))
        replaced = asyncio.ensure_future(self._replaced.wait())
        try:
            await asyncio.wait({self._next_ready, replaced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            replaced.cancel()
        if self._next_ready.done():
            task, self._next_ready = self._next_ready, None
            return task.result()
        raise BroadcastError(f"the trainer replaced broadcast group {group_id}; leave it and join the new one")

    async def _current_group_id(self) -> str | None:
        kv = await self.index.kv()
        try:
            entry = await kv.get(broadcast_group_key(self.run_id))
        except KeyNotFoundError:
            return None
        return decode(entry.value, BroadcastGroup, max_bytes=None).group_id if entry.value else None

    async def close(self) -> None:
        await cancel_and_wait(self._next_ready, self._group_watch)
        self._next_ready = self._group_watch = None
        if self.group is not None:
            self.group.shutdown()  # its communicator released (a failed one was aborted already)
        self.group, self.group_info = None, None  # the next receive() joins the group announced then
        if self._ready is not None:
            ready, self._ready = self._ready, None
            await ready.aclose()  # type: ignore[attr-defined]
