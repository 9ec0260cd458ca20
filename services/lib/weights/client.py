"""Publish weight versions from the trainer and pull them into engines, through a blob store + the bus.

API (everything takes an already connected ``nats.aio.client.Client``)::

    store = ObjectStoreBlobs(nc)                       # or open_store(config, nc): objstore | s3 | fs
    pub = WeightPublisher(nc, run_id, store, encoding=EncodingConfig(anchor_every=10, dtype="bf16"))
    manifest = await pub.publish(model.state_dict(), version)   # returns once stored durably + announced

    sub = WeightSubscriber(nc, run_id, store)
    manifest = await sub.latest()                      # WeightManifest | None
    async for ann in sub.watch():                      # WeightAnnouncement, new versions as they come
        try:
            state = await sub.fetch(ann.manifest)      # dict[str, torch.Tensor], verified, caller owns it
        except WeightIntegrityError as err:            # names the chunk; nothing applied
            log.warning("%s", err)                     # keep the current version
            continue
        model.load_state_dict(state, strict=False)

* ``publish`` writes the chunks, then the manifest (KV ``<run>.v.<version>``),
  then the announcement (KV ``<run>.latest`` + subject
  ``rlbus.<run>.weights.announce.<scope>``); see ``proto/weights.py``.
* Versions are full safetensors anchors every ``anchor_every`` versions and
  sparse deltas in between. ``fetch`` applies a delta to the version it holds
  when that is the delta's base, and otherwise rebuilds from the newest anchor
  plus the deltas after it (a late joiner). Every chunk's digest, the blob
  root, the reconstructed state's digest (BLAKE3 by default; SHA-256 when the
  manifest names it) and (with a key) the manifest HMAC are checked before
  anything is returned; a failure raises
  :class:`WeightIntegrityError` and leaves the subscriber on its old version.
* Buckets are provisioned idempotently on first use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple

import torch
from nats.aio.client import Client as NATS

from proto.weights import MAIN_SCOPE, WeightAnnouncement, WeightManifest
from services.lib.weights.blobs import (
    WeightIntegrityError,
    read_chunks,
    sign,
    verify_signature,
    write_chunks,
)
from services.lib.weights.encoding import (
    DELTA_ENCODING,
    FULL_ENCODING,
    CodecError,
    FullBlob,
    apply_delta,
    decode_full,
    delta_encodable,
    digest_hex,
    encode_delta,
    encode_full,
    root_digest,
    same_layout,
    split_aliases,
)
from services.lib.weights.index import VersionIndex
from services.lib.weights.store import BlobStore
from services.runtime import tracing
from services.runtime.weights_config import EncodingConfig

__all__ = [
    "WeightIntegrityError",
    "WeightPublisher",
    "WeightSubscriber",
    "VersionOrderError",
    "cast_for_publish",
]

log = logging.getLogger("rlbus.weightsync.client")


class VersionOrderError(ValueError):
    """A version was published that is not newer than the previous one."""


def cast_for_publish(state_dict: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Detached CPU tensors to publish; ``dtype="bf16"`` casts floating-point tensors to bfloat16."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        t = t.detach()
        if dtype == "bf16" and t.is_floating_point() and t.dtype != torch.bfloat16:
            t = t.to(torch.bfloat16)
        out[name] = t
    return out


class _Encoded(NamedTuple):
    """A version as it is stored: the blob (full or delta), its kind, tensor table and encoding, the full layout
    (the next delta's base), the state's digest and the tensor aliases."""

    blob: bytes | bytearray
    kind: str
    tensors: Any
    encoding: str
    full: FullBlob
    state_sha: str
    aliases: Any


_MAX_DELTA_PAUSE = 32  # versions published as anchors before a delta is tried again (at most)

class WeightPublisher:
    """The trainer side: encode, store and announce each new weight version."""

    def __init__(
        self,
        nc: NATS,
        run_id: str,
        store: BlobStore,
        *,
        scope: str = MAIN_SCOPE,
        encoding: EncodingConfig | None = None,
        hmac_key: bytes | None = None,
        parallel: int = 4,
    ) -> None:
        self.run_id = run_id
        self.store = store
        self.encoding = encoding or EncodingConfig()
        self.index = VersionIndex(nc, run_id, scope)
        self.hmac_key = hmac_key
        self.parallel = parallel
        self._prev: FullBlob | None = None
        self._prev_version: int | None = None
        self._anchor_version: int | None = None
        self._since_anchor = 0
        #: after a delta came out too dense, the next versions go out as anchors without trying a
        #: delta (encoding one costs ~7x a full encode); the pause doubles while deltas stay dense
        self._delta_pause = 0
        self._delta_backoff = 0
        self._ready = False

    async def ensure(self) -> None:
        """Provision the store and the KV bucket (idempotent)."""
        if not self._ready:
            await self.store.ensure()
            await self.index.ensure()
            self._ready = True

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        """Store ``state_dict`` as ``version`` and announce it; returns once it is durable."""
        if self._prev_version is not None and version <= self._prev_version:
            raise VersionOrderError(
                f"version {version} is not newer than the last published {self._prev_version}"
            )
        await self.ensure()
        with tracing.span("encode weights", version=version) as span:  # the stages as spans: bench/bus_gaps.py
            enc = await self._encode(state_dict, version)
            span.set_attribute("kind", enc.kind)
            span.set_attribute("bytes", len(enc.blob))
        blob, kind, tensors, full = enc.blob, enc.kind, enc.tensors, enc.full
        digest = self.encoding.digest
        with tracing.span("store weights", version=version):
            chunks = await write_chunks(
                self.store, self.run_id, version, kind, blob, self.encoding.chunk_bytes, self.parallel, digest
            )
        anchor = version if kind == "full" else self._anchor_version
        manifest = WeightManifest(
            version=version,
            kind=kind,
            base_version=self._prev_version if kind == "delta" else None,
            anchor_version=anchor if anchor is not None else version,
            tensors=tensors,
            full_nbytes=len(full.buf),
            data_offset=full.data_offset,
            chunks=chunks,
            blob_nbytes=len(blob),
            blob_sha256=root_digest(chunks, digest),
            state_sha256=enc.state_sha,
            digest=digest,
            encoding=enc.encoding,
            store=self.store.kind,
            aliases=enc.aliases,
        )
        manifest = sign(self.hmac_key, manifest)
        with tracing.span("announce weights", version=version):
            # together: an engine fetches the announced manifest itself (it reads stored manifests only for
            # the older bases of a delta chain), so the announcement need not wait for this one's KV entry; a
            # failure of either fails the publish, which the sender retries whole
            await asyncio.gather(self.index.put_manifest(manifest), self.index.announce(
                WeightAnnouncement(
                    run_id=self.run_id, policy_version=version, scope=self.index.scope, manifest=manifest,
                    traceparent=tracing.traceparent(),
                )
            ))
        self._prev, self._prev_version = full, version
        if kind == "full":
            self._anchor_version, self._since_anchor = version, 0
        else:
            self._since_anchor += 1
        log.info(
            "published weights v%d (%s, %d bytes in %d chunks, anchor v%d)",
            version,
            kind,
            len(blob),
            len(chunks),
            manifest.anchor_version,
        )
        return manifest

    async def _encode(self, state_dict: Mapping[str, torch.Tensor], version: int) -> _Encoded:
        """``state_dict`` as the blob to store: a full anchor, or a sparse delta against the previous version
        when one is due and small enough."""
        sd, aliases = split_aliases(state_dict)
        sd = cast_for_publish(sd, self.encoding.dtype)
        full = await asyncio.to_thread(encode_full, sd)
        state_sha = await asyncio.to_thread(full.state_digest, self.encoding.digest)

        blob: bytes | bytearray = full.buf
        kind, tensors, encoding = "full", full.tensors, FULL_ENCODING
        prev = self._delta_base(full)
        if prev is not None and self._delta_pause > 0:
            self._delta_pause -= 1
            prev = None
        if prev is not None:
            dblob, dtensors = await asyncio.to_thread(
                encode_delta, prev.buf, full.buf, full.tensors, self.encoding.zstd_level
            )
            if len(dblob) <= self.encoding.max_delta_fraction * len(full.buf):
                blob, kind, tensors, encoding = dblob, "delta", dtensors, DELTA_ENCODING
                self._delta_backoff = 0
            else:
                self._delta_backoff = min(max(1, 2 * self._delta_backoff), _MAX_DELTA_PAUSE)
                self._delta_pause = self._delta_backoff
                log.info(
                    "version %d: delta is %d bytes, over the limit; publishing anchors for the next %d versions "
                    "without trying a delta", version, len(dblob), self._delta_pause,
                )
        return _Encoded(blob, kind, tensors, encoding, full, state_sha, aliases)

    def _delta_base(self, full: FullBlob) -> FullBlob | None:
        """The previous version if the next one may be a delta against it, else None (anchor due)."""
        prev = self._prev
        if (
            prev is not None
            and self._since_anchor + 1 < self.encoding.anchor_every
            and same_layout(prev.tensors, full.tensors)
            and len(prev.buf) == len(full.buf)
            and delta_encodable(full.tensors)
        ):
            return prev
        return None


class WeightSubscriber:
    """The engine side: find, watch, fetch and verify weight versions."""

    def __init__(
        self,
        nc: NATS,
        run_id: str,
        store: BlobStore,
        *,
        scope: str = MAIN_SCOPE,
        hmac_key: bytes | None = None,
        parallel: int = 4,
    ) -> None:
        self.run_id = run_id
        self.store = store
        self.index = VersionIndex(nc, run_id, scope)
        self.hmac_key = hmac_key
        self.parallel = parallel
        #: full layout of the version this subscriber holds (the base for the next delta)
        self._state: bytearray | None = None
        self._state_manifest: WeightManifest | None = None
        self._ready = False

    @property
    def version(self) -> int | None:
        """The version last fetched successfully, or None."""
        return self._state_manifest.version if self._state_manifest else None

    async def ensure(self) -> None:
        if not self._ready:
            await self.store.ensure()
            await self.index.ensure()
            self._ready = True

    async def latest(self) -> WeightManifest | None:
        """The manifest of the newest announced version, or None before the first."""
        await self.ensure()
        ann = await self.index.latest()
        return None if ann is None else ann.manifest

    async def watch(self, include_current: bool = True) -> AsyncIterator[WeightAnnouncement]:
        """Announcements of new versions as they come (starting with the current one if asked)."""
        await self.ensure()
        async for ann in self.index.watch(include_current=include_current):
            yield ann

    async def fetch(self, manifest: WeightManifest, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Fetch, verify and rebuild ``manifest``'s version; return its tensors.

        ``copy=True`` returns tensors the caller owns; ``copy=False`` returns views
        of the subscriber's own buffer, valid only until the next ``fetch``.
        Raises :class:`WeightIntegrityError` (nothing changes) on any mismatch.
        """
        await self.ensure()
        buf = await self.fetch_state(manifest)
        tensors = decode_full(bytearray(buf) if copy else buf, manifest.tensors)
        for alias, canonical in manifest.aliases.items():
            tensors[alias] = tensors[canonical]
        return tensors

    async def fetch_state(self, manifest: WeightManifest) -> bytearray:
        """Rebuild ``manifest``'s version as a full safetensors layout (kept as this subscriber's state)."""
        verify_signature(self.hmac_key, manifest)
        held = self._state_manifest
        state = self._state
        if (
            manifest.kind == "delta"
            and state is not None
            and held is not None
            and held.version == manifest.base_version
        ):
            try:
                await self._apply_on_held(state, held, manifest)
                return state
            except WeightIntegrityError as err:
                if err.chunk is not None:
                    raise  # a corrupt chunk will not be better by the other route
                log.warning(
                    "delta v%d did not verify against v%d held (%s); rebuilding",
                    manifest.version,
                    held.version,
                    err,
                )
        if (
            state is not None
            and held is not None
            and held.version == manifest.version
            and held.digest == manifest.digest
            and held.state_sha256 == manifest.state_sha256
        ):
            return state
        buf = await self._rebuild(manifest)
        self._state, self._state_manifest = buf, manifest
        return buf

    async def _apply_on_held(self, state: bytearray, held: WeightManifest, manifest: WeightManifest) -> None:
        """Apply delta ``manifest`` in place on the held ``state`` (version ``held``); undone if it fails."""
        if not same_layout(held.tensors, manifest.tensors):
            raise WeightIntegrityError(
                f"delta v{manifest.version} has a different tensor layout than v{held.version}",
                version=manifest.version,
            )
        blob = await read_chunks(self.store, manifest, self.parallel)
        try:
            undo = await asyncio.to_thread(apply_delta, state, blob, manifest.tensors)
        except CodecError as err:
            raise WeightIntegrityError(
                f"delta v{manifest.version} cannot be applied: {err}", version=manifest.version
            ) from err
        got = await asyncio.to_thread(digest_hex, memoryview(state)[manifest.data_offset :], manifest.digest)
        if got != manifest.state_sha256:
            await asyncio.to_thread(undo.undo, state)
            raise WeightIntegrityError(
                f"v{manifest.version} rebuilt from v{held.version} + delta has state {manifest.digest} {got}, "
                f"manifest says {manifest.state_sha256}",
                version=manifest.version,
            )
        self._state_manifest = manifest

    async def _chain(self, manifest: WeightManifest) -> list[WeightManifest]:
        """Manifests from the anchor of ``manifest`` up to it, oldest first."""
        chain = [manifest]
        while chain[-1].kind == "delta":
            base = chain[-1].base_version
            prev = None if base is None else await self.index.manifest(base)
            if prev is None:
                raise WeightIntegrityError(
                    f"cannot rebuild v{manifest.version}: manifest of v{base} (a base in its delta chain) is not "
                    "stored; wait for the next anchor",
                    version=manifest.version,
                )
            verify_signature(self.hmac_key, prev)
            chain.append(prev)
        return chain[::-1]

    async def _rebuild(self, manifest: WeightManifest) -> bytearray:
        """A fresh full layout of ``manifest``'s version from its anchor plus deltas (state untouched)."""
        chain = await self._chain(manifest)
        anchor = chain[0]
        buf = await read_chunks(self.store, anchor, self.parallel)
        if len(buf) != anchor.full_nbytes:
            raise WeightIntegrityError(
                f"anchor v{anchor.version} is {len(buf)} bytes, manifest says {anchor.full_nbytes}",
                version=manifest.version,
            )
        for m in chain[1:]:
            blob = await read_chunks(self.store, m, self.parallel)
            try:
                await asyncio.to_thread(apply_delta, buf, blob, m.tensors)
            except CodecError as err:
                raise WeightIntegrityError(
                    f"delta v{m.version} cannot be applied: {err}", version=manifest.version
                ) from err
        if len(chain) > 1:
            got = await asyncio.to_thread(digest_hex, memoryview(buf)[manifest.data_offset :], manifest.digest)
            if got != manifest.state_sha256:
                raise WeightIntegrityError(
                    f"v{manifest.version} rebuilt from anchor v{anchor.version} + {len(chain) - 1} deltas has "
                    f"state {manifest.digest} {got}, manifest says {manifest.state_sha256}",
                    version=manifest.version,
                )
        return buf
