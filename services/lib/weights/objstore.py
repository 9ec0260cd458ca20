"""Weight chunks in the JetStream object store, written and read fast.

Objects keep the standard NATS object-store layout (stream ``OBJ_<bucket>``,
chunk messages on ``$O.<bucket>.C.<nuid>``, meta on ``$O.<bucket>.M.<b64 name>``)
so ``nats object`` tools and nats-py's ``ObjectStore`` still see them. Only the
transfer paths differ from nats-py's:

* put pipelines the chunk publishes (``publish_async`` with a bounded window)
  instead of waiting for each ack in turn;
* read never calls ``ObjectStore.get`` (it appends to ``bytes``, quadratic, and
  answers flow control slowly): an ephemeral pull consumer on the chunk subject
  is drained into the caller's preallocated buffer — by ``rawpull.py`` (a
  second plain connection whose socket writes payloads in place) when the
  connection allows it, else by nats-py ``fetch`` batches.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
from datetime import UTC, datetime

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from proto.weights import object_bucket
from services.lib.weights.rawpull import RawPullError, RawPullReader, open_raw_reader
from services.lib.weights.store import BlobNotFound, StoreError, StoreStats
from services.runtime.weights_config import ObjStoreConfig

log = logging.getLogger("rlbus.weightsync.objstore")

_FETCH_TIMEOUT_S = 30.0
_RAW_REQUEST_BYTES = 32 * 1024 * 1024  # bytes asked for per pull request (two requests kept in flight)
_RAW_OPEN_FAILURES = 3  # consecutive failures to open the fast reader before it is given up
_PUBLISH_WINDOW_BYTES = 128 * 1024 * 1024  # unacknowledged chunk bytes while uploading (bounds the copies held)


async def _acked(window: list[asyncio.Future], timeout_s: float) -> None:
    """Wait for the JetStream acks of ``window``, bounded: when the server dies mid-upload the acks of
    what it had not stored never come, and an unbounded wait would hang the publisher forever."""
    try:
        await asyncio.wait_for(asyncio.gather(*window), timeout_s)
    except TimeoutError as err:
        missing = sum(not f.done() or f.cancelled() for f in window)
        for fut in window:
            fut.cancel()  # frees nats-py's pending-publish slots
        raise StoreError(f"{missing} chunk messages were not acknowledged within {timeout_s:g}s "
                         "(server restarting?)") from err


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


class ObjectStoreBlobs:
    """:class:`~services.lib.weights.store.BlobStore` on a JetStream object-store bucket."""

    kind = "objstore"

    def __init__(self, nc: NATS, config: ObjStoreConfig | None = None, scope: str = "main") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.config = config or ObjStoreConfig()
        self.bucket = self.config.bucket or object_bucket(scope)
        self.stream = f"OBJ_{self.bucket}"
        self.stats = StoreStats()
        self._msg_bytes = self.config.message_bytes
        self._raw_idle: list[RawPullReader] = []
        self._raw_disabled = not self.config.fast_read
        self._raw_failures = 0  # consecutive failures to open the fast reader
        self._dropping: set[asyncio.Task[None]] = set()  # deletions of finished reads' consumers

    async def ensure(self) -> None:
        """Create the bucket if missing; an existing bucket (any config) is used as it is."""
        storage = api.StorageType.FILE if self.config.storage == "file" else api.StorageType.MEMORY
        try:
            await self.js.object_store(self.bucket)
        except BucketNotFoundError:
            try:
                await self.js.create_object_store(self.bucket, storage=storage, replicas=self.config.replicas)
            except BadRequestError:
                await self.js.object_store(self.bucket)  # created concurrently by another process
        server_max = self.nc.max_payload or self._msg_bytes
        if self._msg_bytes > server_max - 1024:
            self._msg_bytes = max(4096, server_max - 1024)
            log.info("objstore message size capped to %d by the server's max_payload", self._msg_bytes)

    async def _info(self, name: str) -> api.ObjectInfo | None:
        try:
            msg = await self.js.get_last_msg(self.stream, _meta_subject(self.bucket, name))
        except NotFoundError:
            return None
        info = api.ObjectInfo.from_response(json.loads(msg.data))
        return None if info.deleted else info

    async def put(self, name: str, data: memoryview, digest: str, algo: str | None = None) -> None:
        """Publish ``data`` as chunk messages (pipelined acks), then the meta message.

        The meta's digest is SHA-256, as the object-store format requires (``nats object get``
        checks it): ``digest`` when ``algo`` is ``sha256``, else hashed here.
        """
        data = memoryview(data).cast("B")
        if algo == "sha256":
            sha256 = digest
        elif len(data) < 1 << 20:
            sha256 = hashlib.sha256(data).hexdigest()
        else:
            sha256 = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        old = await self._info(name)
        nuid = self.nc._nuid.next().decode()
        subj = _chunk_subject(self.bucket, nuid)
        window: list[asyncio.Future[api.PubAck]] = []
        window_max = min(self.config.publish_window, max(2, _PUBLISH_WINDOW_BYTES // self._msg_bytes))
        chunks = 0
        try:
            for off in range(0, len(data), self._msg_bytes):
                window.append(await self.js.publish_async(subj, bytes(data[off : off + self._msg_bytes])))
                chunks += 1
                if len(window) >= window_max:
                    await _acked(window, self.config.ack_timeout_s)
                    window.clear()
            await _acked(window, self.config.ack_timeout_s)
        except Exception as err:
            await self.js.purge_stream(self.stream, subject=subj)
            raise StoreError(f"objstore put of {name!r} into bucket {self.bucket} failed: {err}") from err
        info = api.ObjectInfo(
            name=name,
            bucket=self.bucket,
            nuid=nuid,
            size=len(data),
            chunks=chunks,
            mtime=datetime.now(UTC).isoformat(),
            digest="SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256)).decode(),
            options=api.ObjectMetaOptions(max_chunk_size=self._msg_bytes),
        )
        await self.js.publish(
            _meta_subject(self.bucket, name),
            json.dumps(info.as_dict()).encode(),
            headers={api.Header.ROLLUP: "sub"},
        )
        if old is not None:
            await self.js.purge_stream(self.stream, subject=_chunk_subject(self.bucket, old.nuid))
        self.stats.bytes_written += len(data)
        self.stats.blobs_written += 1

    async def read_into(self, name: str, out: memoryview) -> None:
        """Pull every chunk message of ``name`` in order, copying each once into ``out``."""
        info = await self._info(name)
        if info is None:
            raise BlobNotFound(f"object {name!r} not found in bucket {self.bucket}")
        size, nchunks = int(info.size or 0), int(info.chunks or 0)
        if size != len(out):
            raise StoreError(
                f"object {name!r} in bucket {self.bucket} has {size} bytes, the manifest says {len(out)}"
            )
        if size == 0:
            return
        subject = _chunk_subject(self.bucket, info.nuid)
        if not self._raw_disabled:
            reader = await self._raw_reader()
            if reader is not None:
                try:
                    pos = await self._read_raw(reader, subject, info, nchunks, out)
                finally:
                    if reader.usable():
                        self._raw_idle.append(reader)
                    else:
                        reader.close()
                self._account(name, pos, size)
                return
        pos = await self._read_nats_py(subject, name, nchunks, out)
        self._account(name, pos, size)

    def _account(self, name: str, pos: int, size: int) -> None:
        if pos != size:
            raise StoreError(f"object {name!r} in bucket {self.bucket}: read {pos} of {size} bytes")
        self.stats.bytes_read += size
        self.stats.blobs_read += 1

    def _consumer_config(self, subject: str) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=self.nc._nuid.next().decode(),
            filter_subject=subject,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=60.0,
            mem_storage=True,
            num_replicas=1,  # an ephemeral reader needs no replicas (on an R3 stream it would inherit 3 and stall)
        )

    async def _raw_reader(self) -> RawPullReader | None:
        while self._raw_idle:
            reader = self._raw_idle.pop()
            if reader.usable():
                return reader
            reader.close()
        try:
            reader = await open_raw_reader(self.nc)
        except (OSError, RawPullError, TimeoutError) as err:
            # a failure to open (a timeout on a loaded machine, a server restarting) is this read's only:
            # the fast reader is given up after several in a row, not after one
            self._raw_failures += 1
            if self._raw_failures >= _RAW_OPEN_FAILURES:
                self._raw_disabled = True
            log.warning("fast chunk reader could not open (%s: %s; %d in a row)%s; this read uses nats-py",
                        type(err).__name__, err or "no detail", self._raw_failures,
                        ", giving it up" if self._raw_disabled else "")
            return None
        if reader is None:
            self._raw_disabled = True
            log.info("fast chunk reader not usable on this connection (TLS or nkey/JWT auth); using nats-py")
            return None
        self._raw_failures = 0
        return reader

    async def _read_raw(
        self, reader: RawPullReader, subject: str, info: api.ObjectInfo, nchunks: int, out: memoryview
    ) -> int:
        cfg = self._consumer_config(subject)
        await self.js.add_consumer(self.stream, config=cfg)
        msg_size = (info.options.max_chunk_size if info.options else 0) or max(1, len(out) // max(1, nchunks))
        batch = max(1, min(self.config.fetch_batch, _RAW_REQUEST_BYTES // msg_size))
        try:
            return await reader.read(self.stream, cfg.name, nchunks, out, batch, _FETCH_TIMEOUT_S)
        except RawPullError as err:
            reader.close()
            raise StoreError(f"reading {subject} from stream {self.stream} failed: {err}") from err
        finally:
            self._drop_consumer(cfg.name)

    def _drop_consumer(self, name: str) -> None:
        """Delete a finished read's ephemeral consumer beside what follows, not before the read returns: one
        round trip less on every weight fetch (the engine applies the version meanwhile). One whose deletion
        fails is removed by the server after its ``inactive_threshold``."""

        async def drop() -> None:
            try:
                await self.js.delete_consumer(self.stream, name)
            except NotFoundError:
                pass
            except Exception as e:  # the bus away: the server's inactivity threshold removes it
                log.debug("could not delete read consumer %s on %s: %s", name, self.stream, e)

        task = asyncio.create_task(drop(), name=f"objstore-drop-consumer-{name}")
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def _read_nats_py(self, subject: str, name: str, nchunks: int, out: memoryview) -> int:
        """Fallback: nats-py pull consumer, ``fetch`` in batches, each payload copied into ``out``."""
        cfg = self._consumer_config(subject)
        size = len(out)
        # a fetch asks for at most _RAW_REQUEST_BYTES (big chunks: fewer per fetch): fetch_batch chunks of a
        # 538 MB model at once overran the server's 64 MB max_pending, which cut the reader off as a slow
        # consumer again and again
        chunk = max(1, size // max(1, nchunks))
        per_fetch = max(1, min(self.config.fetch_batch, _RAW_REQUEST_BYTES // chunk))
        psub = await self.js.pull_subscribe(subject, stream=self.stream, config=cfg,
                                            pending_bytes_limit=max(256 * 1024 * 1024, 2 * per_fetch * chunk))
        pos = received = 0
        try:
            while received < nchunks:
                msgs = await psub.fetch(min(per_fetch, nchunks - received), timeout=_FETCH_TIMEOUT_S)
                for m in msgs:
                    n = len(m.data)
                    if pos + n > size:
                        raise StoreError(
                            f"object {name!r} in bucket {self.bucket} has more data than its meta says"
                        )
                    out[pos : pos + n] = m.data
                    pos += n
                received += len(msgs)
        finally:
            await psub.unsubscribe()
            self._drop_consumer(cfg.name)
        return pos

    async def delete(self, name: str) -> None:
        """Purge the object's chunk messages and its meta message (no tombstone is left)."""
        info = await self._info(name)
        if info is None:
            return
        await self.js.purge_stream(self.stream, subject=_chunk_subject(self.bucket, info.nuid))
        await self.js.purge_stream(self.stream, subject=_meta_subject(self.bucket, name))
        self.stats.blobs_deleted += 1

    async def list(self, prefix: str) -> list[str]:
        names: list[str] = []
        store = await self.js.object_store(self.bucket)
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return names
        for info in infos:
            if info.name.startswith(prefix) and not info.deleted:
                names.append(info.name)
        return sorted(names)

    async def close(self) -> None:
        """Close the fast readers' connections (the caller's NATS connection stays open), once the read
        consumers being deleted are gone (bounded: the server drops them after their inactivity anyway)."""
        if self._dropping:
            await asyncio.wait(set(self._dropping), timeout=5.0)
        for reader in self._raw_idle:
            reader.close()
        self._raw_idle.clear()
