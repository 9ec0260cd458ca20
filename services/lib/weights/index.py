"""The version index of one scope on the bus: manifests and the latest announcement in KV, plus the subject."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from proto import catalog
from proto.codec import decode, encode
from proto.weights import (
    MAIN_SCOPE,
    WeightAnnouncement,
    WeightManifest,
    kv_bucket,
    latest_key,
    version_key,
    version_key_prefix,
)

log = logging.getLogger("rlbus.weightsync.index")

_MAX_MANIFEST_BYTES = 64 * 1024 * 1024


async def stop_watch(watcher: KeyValue.KeyWatcher) -> None:
    """Stop a KV watch and delete its consumer. nats-py's ``stop()`` only unsubscribes and the server keeps
    the ephemeral consumer, so every watch would leave one behind: a long run (retention lists the versions
    after each one) piles them up until JetStream refuses new ones ("maximum consumers limit reached")."""
    sub = watcher._sub  # nats-py's push subscription: the stream and consumer of the watch
    await watcher.stop()
    try:
        await sub._js.delete_consumer(sub._stream, sub._consumer)
    except NotFoundError:
        pass  # already gone (an ordered consumer that was reset, or the server's own clean-up)
    except Exception as e:  # the bus is away: the consumer is left behind (one, not one per watch)
        log.debug("could not delete the consumer of a stopped watch on %s: %s", sub._stream, e)


class VersionIndex:
    """KV bucket ``rlbus_weights_<scope>`` and subject ``rlbus.<run>.weights.announce.<scope>`` of one run."""

    def __init__(self, nc: NATS, run_id: str, scope: str = MAIN_SCOPE) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.run_id = run_id
        self.scope = scope
        self.bucket = kv_bucket(scope)
        self.subject = catalog.WEIGHT_ANNOUNCEMENTS.subject(run_id, scope)
        self._kv: KeyValue | None = None

    async def ensure(self) -> None:
        """Create the KV bucket if missing (idempotent, safe under concurrent creators)."""
        if self._kv is not None:
            return
        try:
            self._kv = await self.js.key_value(self.bucket)
        except BucketNotFoundError:
            try:
                self._kv = await self.js.create_key_value(
                    bucket=self.bucket,
                    history=1,
                    storage=api.StorageType.FILE,
                    description="rlbus weight versions",
                )
            except BadRequestError:
                self._kv = await self.js.key_value(self.bucket)

    async def kv(self) -> KeyValue:
        """The scope's KV bucket (provisioned on first use)."""
        await self.ensure()
        if self._kv is None:
            raise RuntimeError(f"KV bucket {self.bucket} could not be opened")
        return self._kv

    async def _get(self, key: str) -> bytes | None:
        await self.ensure()
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        return entry.value or None

    async def put_manifest(self, manifest: WeightManifest) -> None:
        await self.ensure()
        await self._kv.put(version_key(self.run_id, manifest.version), encode(manifest))

    async def manifest(self, version: int) -> WeightManifest | None:
        """The stored manifest of ``version``, or None if it is not (or no longer) stored."""
        data = await self._get(version_key(self.run_id, version))
        return None if data is None else decode(data, WeightManifest, max_bytes=_MAX_MANIFEST_BYTES)

    async def versions(self) -> list[int]:
        """Every version with a stored manifest, ascending (a watch on ``<run>.v.>``, headers only)."""
        kv = await self.kv()
        prefix = version_key_prefix(self.run_id)
        found: set[int] = set()
        watcher = await kv.watch(f"{prefix}>", meta_only=True, ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is None:  # the end of what is stored now
                    break
                found.add(int(entry.key[len(prefix) :]))
        finally:
            await stop_watch(watcher)
        return sorted(found)

    async def delete_manifest(self, version: int) -> None:
        await self.ensure()
        await self._kv.purge(version_key(self.run_id, version))

    async def announce(self, ann: WeightAnnouncement) -> None:
        """Record ``ann`` as the latest (durable) and publish it on the subject (wake-up)."""
        await self.ensure()
        catalog.WEIGHT_ANNOUNCEMENTS.check(ann)
        data = encode(ann)
        await self._kv.put(latest_key(self.run_id), data)
        await self.nc.publish(self.subject, data, headers={"Nats-Msg-Id": ann.msg_id})
        await self.nc.flush()

    async def latest(self) -> WeightAnnouncement | None:
        data = await self._get(latest_key(self.run_id))
        return None if data is None else decode(data, WeightAnnouncement, max_bytes=_MAX_MANIFEST_BYTES)

    async def watch(self, include_current: bool = True) -> AsyncIterator[WeightAnnouncement]:
        """Announcements as they are recorded, newest-only, strictly increasing versions.

        Backed by a KV watch on ``<run>.latest``, so nothing announced while the
        watcher was starting is missed (a slow reader may skip straight to the
        newest version, which is what an engine wants).
        """
        await self.ensure()
        last = -1
        if not include_current:
            current = await self.latest()
            last = current.policy_version if current is not None else -1
        watcher = await self._kv.watch(latest_key(self.run_id), ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is None or not entry.value:
                    continue
                ann = decode(entry.value, WeightAnnouncement, max_bytes=_MAX_MANIFEST_BYTES)
                if ann.policy_version <= last:
                    continue
                last = ann.policy_version
                yield ann
        finally:
            await stop_watch(watcher)
