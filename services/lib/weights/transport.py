"""One interface for every way weights travel, chosen by one config key ``transport``: store | broadcast | inproc
| vllm (straight into vLLM's workers through vLLM's own weight-transfer API: :mod:`.vllm_transfer`).

The trainer holds a :class:`WeightSender`, each engine a :class:`WeightReceiver`::

    sender = make_sender(config.transport, nc, run_id)      # StoreTransportConfig|BroadcastConfig|InprocConfig
    await sender.start()                                      # provision / form the group
    await sender.send(model.state_dict(), version)            # returns once durable (store) or delivered
    kept = await sender.latest()                              # (version, state) the transport keeps, or None
    await sender.close()

    receiver = make_receiver(config.transport, nc, run_id)
    async for version, state in receiver:                     # each newer verified version, for ever
        model.load_state_dict(state, strict=False)
    receiver.refused, receiver.last_error                     # versions refused so far, and the last reason

Each transport owns its recovery, so callers hold no retry loops:

* **store**: ``send`` retries while the bus or store is away (back-off 0.5 s doubling to 10 s, for up
  to ``retry_for_s``), integrity and ordering errors (``ValueError``) raise at once; ``latest`` reads
  the newest announced version back through the sender's own index and store, verified. The receiver
  watches announcements, re-reads the latest version after ``recheck_s`` without one (a missed
  announcement) and re-subscribes after a bounded back-off when the watch breaks (a server restart).
* **broadcast**: every collective is bounded by ``timeout_s``; a failed one aborts its communicator. A
  failed ``start``/``send`` re-forms the group (engines that died rejoin when they restart) and tries
  again for up to ``reform_for_s``; a send still failing then raises :class:`VersionNotDelivered` (only
  that version is lost; the trainer goes on and its next version replaces it). A receiver leaves a
  broken or replaced group and joins the new one inside the iteration. Keeps nothing: ``latest`` is None.
* **inproc**: tensors handed over in one process, cloned on send by default (``snapshot``), so the
  sender may change its own tensors once ``send`` returns. Keeps nothing: ``latest`` is None.

The iteration skips a version that fails verification (logged once with the reason, counted in
``refused`` / ``last_error``, the current version kept). ``receive()`` is the single step under it:
the next newer version, or an exception (:class:`~services.lib.weights.blobs.WeightIntegrityError`,
:class:`~services.lib.weights.broadcast.BroadcastError`, bus errors).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

import torch
from nats.aio.client import Client as NATS

from proto.weights import WeightAnnouncement, WeightManifest
from services.lib.weights.blobs import WeightIntegrityError
from services.lib.weights.client import WeightPublisher, WeightSubscriber
from services.lib.weights.store import BlobNotFound, open_store
from services.runtime.tasks import cancel_and_wait
from services.runtime.weights_config import (
    BroadcastConfig,
    ConfigError,
    InprocConfig,
    StoreTransportConfig,
    TransportConfig,
    VllmTransferConfig,
    load_hmac_key,
)

log = logging.getLogger("rlbus.weightsync.transport")

T = TypeVar("T")


class VersionNotDelivered(RuntimeError):
    """A transport that keeps nothing (broadcast) could not deliver this version, after its own recovery: only
    this send failed. The trainer goes on training; its next version replaces this one (the engines keep their
    current weights meanwhile, and their samples are weighed by version as always)."""
Weights = tuple[int, dict[str, torch.Tensor]]

#: back-off of retries and re-subscriptions: doubles from the first to the last, then stays
BACKOFF_FIRST_S = 0.5
BACKOFF_LAST_S = 10.0


class WeightSender(Protocol):
    """Trainer side of a transport."""

    async def start(self) -> None:
        """Provision / rendezvous; call once before the first send."""
        ...

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Deliver ``version``; returns once receivers can have it (durable in the store, or broadcast).
        The caller may change its tensors as soon as it returns."""
        ...

    async def latest(self) -> Weights | None:
        """``(version, state)`` of the newest version the transport keeps durably, verified; None if none."""
        ...

    async def close(self) -> None: ...


class WeightReceiver(Protocol):
    """Engine side of a transport: ``async for version, state in receiver`` (see the module docstring)."""

    #: versions refused so far (failed verification), and the last reason
    refused: int
    last_error: str
    #: per version received, the ``traceparent`` its sender announced ("" when unknown): the engine's
    #: "apply weights" span links to it
    traces: dict[int, str]
    #: per version received, the digest it was verified against (``<algorithm>:<hex>``: a store manifest's
    #: ``state_sha256``, a broadcast's trailer); "" when the transport verifies nothing (inproc)
    digests: dict[int, str]

    @property
    def version(self) -> int | None:
        """The version last received, or None."""
        ...

    async def start(self) -> None:
        """Subscribe / join now (optional: the first ``receive`` does it)."""
        ...

    async def receive(self) -> Weights:
        """Wait for the next version newer than the one held; return it verified (or raise)."""
        ...

    def __aiter__(self) -> AsyncIterator[Weights]: ...

    async def close(self) -> None: ...


async def follow(receiver: WeightReceiver,
                 recover: Callable[[], Awaitable[None]] | None) -> AsyncIterator[Weights]:
    """Every version ``receiver.receive()`` returns, for ever: a refused version is counted and skipped;
    a :class:`ConfigError` is raised; any other failure calls ``recover`` (drop the watch / leave the
    group), waits a bounded back-off and receives again."""
    delay = BACKOFF_FIRST_S
    while True:
        try:
            got = await receiver.receive()
        except WeightIntegrityError as err:
            receiver.refused += 1
            receiver.last_error = str(err)
            log.error("refused weight version %d: %s (keeping version %s)", err.version, err,
                      receiver.version)
            continue
        except ConfigError:  # a setting this engine cannot serve (NCCL without its device): no retry mends it
            raise
        except Exception as err:
            log.warning("weight transport interrupted (%s: %s); again in %.1fs", type(err).__name__, err,
                        delay)
            if recover is not None:
                try:
                    await recover()
                except Exception as e:
                    log.debug("recovering the weight receiver: %s", e)
            await asyncio.sleep(delay)  # back-off: the server or the trainer is restarting
            delay = min(2 * delay, BACKOFF_LAST_S)
            continue
        delay = BACKOFF_FIRST_S
        yield got


def store_publisher(config: StoreTransportConfig, nc: NATS, run_id: str) -> WeightPublisher:
    """The :class:`WeightPublisher` a store transport config describes (store, scope, encoding, HMAC)."""
    return WeightPublisher(
        nc,
        run_id,
        open_store(config.store, nc, scope=config.scope),
        scope=config.scope,
        encoding=config.encoding,
        hmac_key=load_hmac_key(config.hmac_key_env),
        parallel=config.parallel,
    )


def store_subscriber(config: StoreTransportConfig, nc: NATS, run_id: str) -> WeightSubscriber:
    """The :class:`WeightSubscriber` a store transport config describes (store, scope, HMAC)."""
    return WeightSubscriber(
        nc,
        run_id,
        open_store(config.store, nc, scope=config.scope),
        scope=config.scope,
        hmac_key=load_hmac_key(config.hmac_key_env),
        parallel=config.parallel,
    )


class StoreSender:
    """:class:`WeightSender` through a blob store + announcements (:class:`WeightPublisher`)."""

    def __init__(self, config: StoreTransportConfig, nc: NATS, run_id: str) -> None:
        self.config = config
        self.nc = nc
        self.run_id = run_id
        self.publisher = store_publisher(config, nc, run_id)
        #: tries that failed and were retried (all sends and reads together)
        self.retries = 0

    async def start(self) -> None:
        await self._retrying("provisioning the weight store", self.publisher.ensure)

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self._retrying(f"publishing weights version {version}",
                             lambda: self.publisher.publish(state_dict, version))

    async def latest(self) -> Weights | None:
        async def read() -> Weights | None:
            ann = await self.publisher.index.latest()
            if ann is None:
                return None
            reader = WeightSubscriber(self.nc, self.run_id, self.publisher.store, scope=self.config.scope,
                                      hmac_key=self.publisher.hmac_key, parallel=self.config.parallel)
            return ann.policy_version, await reader.fetch(ann.manifest)

        return await self._retrying("reading the newest kept weights version", read)

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` until it succeeds; bus and store failures are retried with back-off for up to
        ``retry_for_s``; integrity, ordering and missing-blob errors raise at once."""
        deadline = time.monotonic() + self.config.retry_for_s
        delay = BACKOFF_FIRST_S
        while True:
            try:
                return await attempt()
            except (WeightIntegrityError, ValueError, BlobNotFound):
                raise
            except Exception as err:
                if time.monotonic() + delay > deadline:
                    raise
                self.retries += 1
                log.warning("%s failed (%s: %s); retrying in %.1fs", what, type(err).__name__, err, delay)
                await asyncio.sleep(delay)  # back-off: the server is restarting
                delay = min(2 * delay, BACKOFF_LAST_S)

    async def close(self) -> None:
        await self.publisher.store.close()


def _identity(manifest: WeightManifest) -> tuple[int, str, str]:
    return manifest.version, manifest.blob_sha256, manifest.state_sha256


class StoreReceiver:
    """:class:`WeightReceiver` through a blob store: watches announcements, re-checks the latest, fetches."""

    def __init__(self, config: StoreTransportConfig, nc: NATS, run_id: str) -> None:
        self.config = config
        self.subscriber = store_subscriber(config, nc, run_id)
        self.refused = 0
        self.last_error = ""
        self.traces: dict[int, str] = {}
        self.digests: dict[int, str] = {}
        self._watch: AsyncIterator[WeightAnnouncement] | None = None
        #: an anext() of the watch in flight; it outlives re-checks and cancelled receives
        self._next: asyncio.Future[WeightAnnouncement] | None = None
        self._refused: tuple[int, str, str] | None = None  # the manifest refused last (not fetched again)

    @property
    def version(self) -> int | None:
        return self.subscriber.version

    def __aiter__(self) -> AsyncIterator[Weights]:
        return follow(self, self._unwatch)

    async def start(self) -> None:
        await self.subscriber.ensure()
        if self._watch is None:
            self._watch = aiter(self.subscriber.watch(include_current=True))

    async def receive(self) -> Weights:
        while True:
            manifest = await self._next_manifest()
            if manifest is None or not self._wanted(manifest):
                continue
            try:
                state = await self.subscriber.fetch(manifest)
            except WeightIntegrityError:
                self._refused = _identity(manifest)
                raise
            self.digests = {v: d for v, d in self.digests.items() if v > manifest.version - 8}
            self.digests[manifest.version] = f"{manifest.digest}:{manifest.state_sha256}"
            return manifest.version, state

    def _wanted(self, manifest: WeightManifest) -> bool:
        """Newer than the version held, and not the manifest refused last."""
        held = self.subscriber.version
        return (held is None or manifest.version > held) and _identity(manifest) != self._refused

    async def _next_manifest(self) -> WeightManifest | None:
        """The next announced manifest, or the latest stored one when none came within ``recheck_s``."""
        await self.start()
        if self._next is None:
            self._next = asyncio.ensure_future(anext(self._watch))  # type: ignore[arg-type]
        done, _ = await asyncio.wait({self._next}, timeout=self.config.recheck_s)
        if not done:
            manifest = await self.subscriber.latest()
            if manifest is not None and self._wanted(manifest):
                # the watch missed an announcement: it may be stuck (a server restart); subscribe afresh
                log.info("re-check found weights version %d that the watch did not announce; re-subscribing",
                         manifest.version)
                await self._unwatch()
            return manifest
        task, self._next = self._next, None
        try:
            announcement = task.result()
            if announcement.traceparent:
                self.traces[announcement.policy_version] = announcement.traceparent
                for old in [v for v in self.traces if v < announcement.policy_version - 8]:
                    del self.traces[old]  # bounded: only recent versions are applied
            return announcement.manifest
        except StopAsyncIteration:
            raise ConnectionError("the weight announcement watch ended") from None

    async def _unwatch(self) -> None:
        """Drop the watch (the next receive subscribes again)."""
        task, self._next = self._next, None
        if task is not None:
            await cancel_and_wait(task)
            if not task.cancelled() and task.exception() is not None:
                log.debug("the dropped announcement watch had failed: %s", task.exception())
        watch, self._watch = self._watch, None
        if watch is not None:
            try:
                await watch.aclose()  # type: ignore[attr-defined]
            except Exception as e:
                log.debug("closing the announcement watch: %s", e)

    async def close(self) -> None:
        await self._unwatch()
        await self.subscriber.store.close()


def make_sender(config: TransportConfig, nc: NATS | None, run_id: str,
                device: str | torch.device | None = None) -> WeightSender:
    """The trainer side of the transport ``config`` selects; ``device``: where the trainer's weights live (an NCCL
    broadcast stages its buckets there)."""
    if isinstance(config, StoreTransportConfig):
        if nc is None:
            raise ValueError("the store transport needs a NATS connection")
        return StoreSender(config, nc, run_id)
    if isinstance(config, BroadcastConfig):
        from services.lib.weights.broadcast import BroadcastSender

        if nc is None:
            raise ValueError("the broadcast transport needs a NATS connection for its rendezvous")
        return BroadcastSender(config, nc, run_id, device=device)
    if isinstance(config, InprocConfig):
        from services.lib.weights.inproc import InprocSender

        return InprocSender(config, run_id)
    if isinstance(config, VllmTransferConfig):
        from services.lib.weights.vllm_transfer import VllmSender

        return VllmSender(config, nc, run_id)
    raise TypeError(f"unknown transport config {type(config).__name__}")


def make_receiver(config: TransportConfig, nc: NATS | None, run_id: str,
                  device: str | torch.device | None = None, engine: object = None) -> WeightReceiver:
    """The engine side of the transport ``config`` selects; ``device``: the engine's device (an NCCL broadcast
    receives into it; required for NCCL, never guessed from the thread's current device); ``engine``: the one it
    feeds, which the vllm transport drives itself."""
    if isinstance(config, StoreTransportConfig):
        if nc is None:
            raise ValueError("the store transport needs a NATS connection")
        return StoreReceiver(config, nc, run_id)
    if isinstance(config, BroadcastConfig):
        from services.lib.weights.broadcast import BroadcastReceiver

        if nc is None:
            raise ValueError("the broadcast transport needs a NATS connection for its rendezvous")
        return BroadcastReceiver(config, nc, run_id, device=device)
    if isinstance(config, InprocConfig):
        from services.lib.weights.inproc import InprocReceiver

        return InprocReceiver(config, run_id)
    if isinstance(config, VllmTransferConfig):
        from services.lib.weights.vllm_receiver import VllmReceiver

        return VllmReceiver(config, nc, run_id, engine)
    raise TypeError(f"unknown transport config {type(config).__name__}")
