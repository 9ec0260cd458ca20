"""One interface for every way weights travel, chosen by config ``type`` (store | broadcast | inproc).

The trainer holds a :class:`WeightSender`, each engine a :class:`WeightReceiver`::

    sender = make_sender(config.transport, nc, run_id)      # StoreTransportConfig | BroadcastConfig | InprocConfig
    await sender.start()
    await sender.send(model.state_dict(), version)            # returns once the version is delivered/durable

    receiver = make_receiver(config.transport, nc, run_id)
    await receiver.start()
    version, state = await receiver.receive()                 # the next version newer than the one held
    model.load_state_dict(state, strict=False)

``receive`` raises :class:`~services.lib.weights.blobs.WeightIntegrityError`
for a version that fails verification (the receiver keeps its version) and
:class:`~services.lib.weights.broadcast.BroadcastError` when a collective
times out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import torch
from nats.aio.client import Client as NATS

from proto.weights import WeightAnnouncement
from services.lib.weights.client import WeightPublisher, WeightSubscriber
from services.lib.weights.config import (
    BroadcastConfig,
    InprocConfig,
    StoreTransportConfig,
    TransportConfig,
    load_hmac_key,
)
from services.lib.weights.store import open_store


class WeightSender(Protocol):
    """Trainer side of a transport."""

    async def start(self) -> None:
        """Provision / rendezvous; call once before the first send."""
        ...

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Deliver ``version``; returns once receivers can have it (stored, or broadcast done)."""
        ...

    async def close(self) -> None: ...


class WeightReceiver(Protocol):
    """Engine side of a transport."""

    @property
    def version(self) -> int | None:
        """The version last received, or None."""
        ...

    async def start(self) -> None: ...

    async def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Wait for the next version newer than the one held; return it verified."""
        ...

    async def close(self) -> None: ...


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
        self.publisher = store_publisher(config, nc, run_id)

    async def start(self) -> None:
        await self.publisher.ensure()

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self.publisher.publish(state_dict, version)

    async def close(self) -> None:
        await self.publisher.store.close()


class StoreReceiver:
    """:class:`WeightReceiver` through a blob store: watches announcements, fetches the newest."""

    def __init__(self, config: StoreTransportConfig, nc: NATS, run_id: str) -> None:
        self.subscriber = store_subscriber(config, nc, run_id)
        self._watch: AsyncIterator[WeightAnnouncement] | None = None

    @property
    def version(self) -> int | None:
        return self.subscriber.version

    async def start(self) -> None:
        await self.subscriber.ensure()
        self._watch = aiter(self.subscriber.watch(include_current=True))

    async def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        if self._watch is None:
            await self.start()
        while True:
            ann = await anext(self._watch)  # type: ignore[arg-type]
            held = self.subscriber.version
            if held is None or ann.policy_version > held:
                return ann.policy_version, await self.subscriber.fetch(ann.manifest)

    async def close(self) -> None:
        if self._watch is not None:
            await self._watch.aclose()  # type: ignore[attr-defined]
            self._watch = None
        await self.subscriber.store.close()


def make_sender(config: TransportConfig, nc: NATS | None, run_id: str) -> WeightSender:
    """The trainer side of the transport ``config`` selects."""
    if isinstance(config, StoreTransportConfig):
        if nc is None:
            raise ValueError("the store transport needs a NATS connection")
        return StoreSender(config, nc, run_id)
    if isinstance(config, BroadcastConfig):
        from services.lib.weights.broadcast import BroadcastSender

        if nc is None:
            raise ValueError("the broadcast transport needs a NATS connection for its rendezvous")
        return BroadcastSender(config, nc, run_id)
    if isinstance(config, InprocConfig):
        from services.lib.weights.inproc import InprocSender

        return InprocSender(config, run_id)
    raise TypeError(f"unknown transport config {type(config).__name__}")


def make_receiver(config: TransportConfig, nc: NATS | None, run_id: str) -> WeightReceiver:
    """The engine side of the transport ``config`` selects."""
    if isinstance(config, StoreTransportConfig):
        if nc is None:
            raise ValueError("the store transport needs a NATS connection")
        return StoreReceiver(config, nc, run_id)
    if isinstance(config, BroadcastConfig):
        from services.lib.weights.broadcast import BroadcastReceiver

        if nc is None:
            raise ValueError("the broadcast transport needs a NATS connection for its rendezvous")
        return BroadcastReceiver(config, nc, run_id)
    if isinstance(config, InprocConfig):
        from services.lib.weights.inproc import InprocReceiver

        return InprocReceiver(config, run_id)
    raise TypeError(f"unknown transport config {type(config).__name__}")
