"""Weight chunks as files in a shared directory (local disk, NFS, a mounted bucket).

Publish is atomic: each blob is written to a temporary name in its final
directory, flushed (and fsynced if configured), then renamed into place, so a
reader never sees a partial chunk. Readers ``readinto`` the caller's buffer.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

from services.lib.weights.store import BlobNotFound, StoreError, StoreStats
from services.runtime.weights_config import FsStoreConfig

_TMP_MARK = ".tmp-"


class FsBlobs:
    """:class:`~services.lib.weights.store.BlobStore` on a directory tree under ``config.root``."""

    kind = "fs"

    def __init__(self, config: FsStoreConfig) -> None:
        self.config = config
        self.root = Path(config.root)
        self.stats = StoreStats()

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") for p in parts) or _TMP_MARK in name:
            raise StoreError(f"invalid blob name {name!r} for the fs store")
        return self.root.joinpath(*parts)

    async def ensure(self) -> None:
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)

    async def put(self, name: str, data: memoryview, digest: str, algo: str | None = None) -> None:
        path = self._path(name)
        await asyncio.to_thread(self._put_sync, path, data)
        self.stats.bytes_written += len(data)
        self.stats.blobs_written += 1

    def _put_sync(self, path: Path, data: memoryview) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.config.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"fs store: cannot write {path}: {err}") from err
        if self.config.fsync:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def read_into(self, name: str, out: memoryview) -> None:
        path = self._path(name)
        await asyncio.to_thread(self._read_sync, path, name, out)
        self.stats.bytes_read += len(out)
        self.stats.blobs_read += 1

    def _read_sync(self, path: Path, name: str, out: memoryview) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise BlobNotFound(f"blob {name!r} not found under {self.root}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != len(out):
                raise StoreError(
                    f"blob {name!r} under {self.root} has {size} bytes, the manifest says {len(out)}"
                )
            pos = 0
            while pos < size:
                n = f.readinto(out[pos:])
                if not n:
                    raise StoreError(f"blob {name!r} under {self.root} ended after {pos} of {size} bytes")
                pos += n

    async def delete(self, name: str) -> None:
        path = self._path(name)
        removed = await asyncio.to_thread(self._delete_sync, path)
        if removed:
            self.stats.blobs_deleted += 1

    def _delete_sync(self, path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()  # only succeeds when empty
            except OSError:
                break
            parent = parent.parent
        return True

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> list[str]:
        names: list[str] = []
        if not self.root.is_dir():
            return names
        for dirpath, _dirs, files in os.walk(self.root):
            rel = Path(dirpath).relative_to(self.root)
            for f in files:
                if _TMP_MARK in f:
                    continue
                name = (rel / f).as_posix() if rel != Path(".") else f
                if name.startswith(prefix):
                    names.append(name)
        return sorted(names)

    async def close(self) -> None:
        """Nothing to release."""
