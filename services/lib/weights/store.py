"""The blob-store interface every weight store implements, and the factory that picks one by config.

A store holds named immutable blobs (the chunks of weight versions). Writers
``put`` a chunk once; readers ``read_into`` a preallocated buffer of the size
the manifest gives (so nothing is ever appended or copied twice). Checksums are
checked by the caller against the manifest, not trusted from the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from services.runtime.weights_config import StoreConfig


class StoreError(RuntimeError):
    """A store operation failed (missing blob, wrong size, backend error); the message names the blob."""


class BlobNotFound(StoreError):
    """The named blob is not in the store (deleted by retention, or never written)."""


@dataclass
class StoreStats:
    """Traffic counters of one store instance (bytes moved through it by this process)."""

    bytes_read: int = 0
    bytes_written: int = 0
    blobs_read: int = 0
    blobs_written: int = 0
    blobs_deleted: int = 0


@runtime_checkable
class BlobStore(Protocol):
    """Named immutable blobs. Implementations: objstore.py, s3.py, fs.py."""

    #: the config ``type`` of this store: objstore | s3 | fs
    kind: str
    stats: StoreStats

    async def ensure(self) -> None:
        """Create the bucket/directory if missing (idempotent)."""
        ...

    async def put(self, name: str, data: memoryview, digest: str, algo: str | None = None) -> None:
        """Store ``data`` under ``name``; return once it is durable.

        ``digest`` is its hex checksum by ``algo`` (``blake3`` or ``sha256``; None when not known):
        a store whose format needs a particular hash (the object store's SHA-256) computes its own
        unless ``algo`` is that hash.
        """
        ...

    async def read_into(self, name: str, out: memoryview) -> None:
        """Read blob ``name`` into ``out``, which has exactly the blob's size (else StoreError)."""
        ...

    async def delete(self, name: str) -> None:
        """Remove blob ``name``; a missing blob is not an error."""
        ...

    async def list(self, prefix: str) -> list[str]:
        """Names of the stored blobs that start with ``prefix``."""
        ...

    async def close(self) -> None:
        """Release connections and clients this store opened."""
        ...


def open_store(config: StoreConfig, nc: NATS | None = None, scope: str = "main") -> BlobStore:
    """The store a config selects (``type``: objstore | s3 | fs). ``nc`` is needed for objstore."""
    from services.runtime.weights_config import FsStoreConfig, ObjStoreConfig, S3StoreConfig

    if isinstance(config, ObjStoreConfig):
        from services.lib.weights.objstore import ObjectStoreBlobs

        if nc is None:
            raise StoreError("the objstore weight store needs a connected NATS client")
        return ObjectStoreBlobs(nc, config, scope=scope)
    if isinstance(config, S3StoreConfig):
        from services.lib.weights.s3 import S3Blobs

        return S3Blobs(config)
    if isinstance(config, FsStoreConfig):
        from services.lib.weights.fs import FsBlobs

        return FsBlobs(config)
    raise StoreError(f"unknown store config {type(config).__name__}")
