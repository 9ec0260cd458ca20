"""The weightsync service: retention of the trainer's versions, and a relay that serves engines nearby.

Relay: watches the upstream announcements; for each new version it pulls the
chunks once from the upstream store (verified), stores them unchanged in the
local store, records the manifest in the local scope's KV and announces it on
``rlbus.<run>.weights.announce.<local scope>``. Engines configured with the
local scope and store then read locally, so N engines cost one upstream read.
A delta whose base the relay has not copied (the relay joined late) pulls the
missing chain from its anchor first. Retention runs on each side after every
new version (see ``retention.py``).

The relay may sit across a long link from the upstream (region B's relay reading region A's store
through a NATS leaf node, deploy/README.md "Two regions"). A watch across a link that dropped can
end or fall silent without an error, so after ``recheck_s`` without an announcement the relay reads
the upstream's latest version itself and, when it is newer than the last one handled, subscribes
afresh; a transient failure (the link or the server away) is logged and retried after a back-off
(doubling to ``recheck_s``), and the version is relayed once the upstream answers again. Versions
announced while the link was down are skipped; only the newest (and the chain it needs) is copied.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from proto.weights import WeightAnnouncement, WeightManifest
from services.lib.weights.blobs import WeightIntegrityError, copy_chunks, read_chunks, verify_signature
from services.lib.weights.index import VersionIndex
from services.lib.weights.store import BlobStore, StoreError, open_store
from services.runtime.config import Loaded, tag_of
from services.runtime.service import ServiceContext
from services.runtime.tasks import cancel_and_wait
from services.runtime.weights_config import ConfigError, StoreTransportConfig, load_hmac_key
from services.weightsync.config import WeightsyncConfig
from services.weightsync.retention import ManifestCache, collect_garbage

log = logging.getLogger("rlbus.weightsync.service")

#: failures of an upstream (or local) bus or store that pass: retried, never the end of the service
_TRANSIENT = (StoreError, nats.errors.Error, nats.js.errors.Error, TimeoutError, ConnectionError, OSError)


@dataclass
class RelayStats:
    """What the relay moved (for metrics and the benchmark)."""

    versions_relayed: int = 0
    upstream_bytes: int = 0
    local_bytes: int = 0
    refused: int = 0
    #: times the upstream (or the link to it) failed and the relay backed off
    upstream_failures: int = 0


class WeightsyncService:
    """Retention and/or relay for one run; ``run(stop)`` until the event is set."""

    def __init__(self, nc: NATS, config: WeightsyncConfig, local_nc: NATS | None = None,
                 gauges: dict[str, float] | None = None, upstream: StoreTransportConfig | None = None) -> None:
        """``upstream``: the trainer's store transport (the run's ``[weights]``; default: the default one)."""
        if not config.run_id:
            raise ConfigError("WeightsyncConfig.run_id is empty; set it (build() fills it from [run] id)")
        upstream = upstream or StoreTransportConfig()
        if config.relay is not None and config.relay.scope == upstream.scope:
            raise ConfigError(f"config key services.weightsync.relay.scope: {config.relay.scope!r} is the trainer's "
                              "scope (weights.scope); a relay needs its own scope")
        self.config = config
        self.hmac_key = load_hmac_key(upstream.hmac_key_env)
        self.upstream_store: BlobStore = open_store(upstream.store, nc, scope=upstream.scope)
        self.upstream = VersionIndex(nc, config.run_id, upstream.scope)
        self._upstream_cache = ManifestCache(self.upstream)
        self.local_store: BlobStore | None = None
        self.local: VersionIndex | None = None
        self._local_cache: ManifestCache | None = None
        if config.relay is not None:
            lnc = local_nc or nc
            self.local_store = open_store(config.relay.store, lnc, scope=config.relay.scope)
            self.local = VersionIndex(lnc, config.run_id, config.relay.scope)
            self._local_cache = ManifestCache(self.local)
        self.stats = RelayStats()
        #: the service's heartbeat gauges (``weightsync/...``), updated after every version and failure
        self.gauges = gauges if gauges is not None else {}
        #: set after each version is fully handled (relayed and collected); tests and benches wait on it
        self.handled = asyncio.Condition()
        self.last_handled: int | None = None

    async def ensure(self) -> None:
        """Provision every bucket this service uses (idempotent)."""
        await self.upstream_store.ensure()
        await self.upstream.ensure()
        if self.local_store is not None and self.local is not None:
            await self.local_store.ensure()
            await self.local.ensure()

    async def run(self, stop: asyncio.Event) -> None:
        """Handle every new upstream version until ``stop`` is set."""
        await self.ensure()
        watch = asyncio.create_task(self._watch(), name="weightsync-watch")
        stopper = asyncio.create_task(stop.wait(), name="weightsync-stop")
        try:
            done, _ = await asyncio.wait({watch, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                watch.result()  # re-raise what ended the watch
        finally:
            await cancel_and_wait(watch, stopper)
            await self.upstream_store.close()
            if self.local_store is not None:
                await self.local_store.close()

    async def _watch(self) -> None:
        """Handle each announcement; re-check and re-subscribe after silence, back off after failures."""
        backoff = 0.5
        while True:
            watch = aiter(self.upstream.watch(include_current=True))
            nxt: asyncio.Future[WeightAnnouncement] | None = None  # an anext() that outlives re-checks
            try:
                while True:
                    if nxt is None:
                        nxt = asyncio.ensure_future(anext(watch))
                    done, _ = await asyncio.wait({nxt}, timeout=self.config.recheck_s)
                    if done:
                        ann, nxt = nxt.result(), None
                        await self._handle_newer(ann)
                    else:
                        latest = await self.upstream.latest()
                        if latest is not None and self._newer(latest):
                            log.info("re-check found v%d that the watch did not announce; re-subscribing",
                                     latest.policy_version)
                            await self._handle_newer(latest)
                            break  # the watch may be stuck (its link dropped): subscribe afresh
                    backoff = 0.5
            except (StopAsyncIteration, *_TRANSIENT) as err:
                self.stats.upstream_failures += 1
                self._report()
                log.warning("upstream unavailable (%r); retrying in %.1fs", err, backoff)
                await asyncio.sleep(backoff)  # back-off while the upstream (or the link to it) is away
                backoff = min(backoff * 2, self.config.recheck_s)
            finally:
                if nxt is not None:
                    await cancel_and_wait(nxt)
                await watch.aclose()  # type: ignore[attr-defined]

    def _newer(self, ann: WeightAnnouncement) -> bool:
        return self.last_handled is None or ann.policy_version > self.last_handled

    async def _handle_newer(self, ann: WeightAnnouncement) -> None:
        if self._newer(ann):
            await self.handle(ann)

    async def handle(self, ann: WeightAnnouncement) -> None:
        """Relay one announced version (and any missing chain) and run retention. A transient failure
        (bus, link or store away) raises and leaves the version unhandled, to be tried again."""
        try:
            if self.local is not None:
                await self._relay(ann)
        except WeightIntegrityError as err:
            self.stats.refused += 1
            log.error("relay refused v%d: %s", ann.policy_version, err)
        if self.config.gc_upstream:
            await collect_garbage(
                self.upstream, self.upstream_store, self.config.keep_anchors, self._upstream_cache
            )
        if self.local is not None and self.local_store is not None and self.config.relay is not None:
            await collect_garbage(
                self.local, self.local_store, self.config.relay.keep_anchors, self._local_cache
            )
        async with self.handled:
            self.last_handled = ann.policy_version
            self.handled.notify_all()
        self._report()

    def _report(self) -> None:
        self.gauges.update({
            "weightsync/relayed_versions": float(self.stats.versions_relayed),
            "weightsync/upstream_bytes": float(self.stats.upstream_bytes),
            "weightsync/upstream_failures": float(self.stats.upstream_failures),
            "weightsync/refused": float(self.stats.refused),
        })
        if self.last_handled is not None:
            self.gauges["weightsync/version"] = float(self.last_handled)

    async def wait_handled(self, version: int) -> None:
        """Wait until ``version`` (or a newer one) has been handled."""
        async with self.handled:
            await self.handled.wait_for(
                lambda: self.last_handled is not None and self.last_handled >= version
            )

    async def _missing_chain(self, manifest: WeightManifest) -> list[WeightManifest]:
        """Versions (oldest first) to copy so the local scope can rebuild ``manifest``."""
        if self._local_cache is None:
            return []
        chain = [manifest]
        m = manifest
        while m.kind == "delta" and m.base_version is not None:
            if await self._local_cache.get(m.base_version) is not None:
                break
            base = await self._upstream_cache.get(m.base_version)
            if base is None:
                raise WeightIntegrityError(
                    f"cannot relay v{manifest.version}: upstream no longer has v{m.base_version} of its chain",
                    version=manifest.version,
                )
            chain.append(base)
            m = base
        return chain[::-1]

    async def _relay(self, ann: WeightAnnouncement) -> None:
        if self.local is None or self.local_store is None or self._local_cache is None:
            return
        if await self._local_cache.get(ann.policy_version) is not None:
            return  # already relayed (a restart re-delivers the current announcement)
        for m in await self._missing_chain(ann.manifest):
            verify_signature(self.hmac_key, m)
            blob = await read_chunks(self.upstream_store, m, self.config.parallel)
            await copy_chunks(blob, self.local_store, m.chunks, self.config.parallel)
            self.stats.upstream_bytes += len(blob)
            self.stats.local_bytes += len(blob)
            await self.local.put_manifest(msgspec.structs.replace(m, store=self.local_store.kind))
        local_manifest = await self._local_cache.get(ann.policy_version)
        if local_manifest is None:
            raise WeightIntegrityError(
                f"relay lost v{ann.policy_version} while copying it", version=ann.policy_version
            )
        await self.local.announce(
            WeightAnnouncement(
                run_id=ann.run_id,
                policy_version=ann.policy_version,
                scope=self.local.scope,
                manifest=local_manifest,
                msg_id=f"{ann.msg_id}-{self.local.scope}",
            )
        )
        self.stats.versions_relayed += 1
        log.info("relayed v%d into scope %s", ann.policy_version, self.local.scope)


class WeightsyncRunner:
    """Adapts :class:`WeightsyncService` (which needs only a connection) to the harness's ``run(ctx)``."""

    def __init__(self, config: WeightsyncConfig, upstream: StoreTransportConfig) -> None:
        self.config = config
        self.upstream = upstream

    async def run(self, ctx: ServiceContext) -> None:
        await WeightsyncService(ctx.nc, self.config, gauges=ctx.gauges, upstream=self.upstream).run(ctx.stop)


def build(loaded: Loaded) -> WeightsyncRunner:
    """The service for a resolved config (section ``[services.weightsync]``); ``run_id`` defaults to the run's."""
    config: WeightsyncConfig = loaded.service
    if not config.run_id:
        config = msgspec.structs.replace(config, run_id=loaded.run.id)
    if not isinstance(loaded.weights, StoreTransportConfig):
        raise ConfigError(f"weightsync keeps and relays versions of the store transport; [weights] type is "
                          f"{tag_of(loaded.weights)!r}: leave weightsync out of [launcher] services")
    return WeightsyncRunner(config, loaded.weights)
