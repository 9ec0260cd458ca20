"""Chunked, checksummed transfer of one version's blob to and from any store; manifest signatures."""

from __future__ import annotations

import asyncio
import hashlib
import hmac as hmac_mod
import logging

import msgspec

from proto.weights import ChunkRef, WeightManifest, chunk_name
from services.lib.weights.encoding import Digest, digest_hex, root_digest, split
from services.lib.weights.store import BlobStore

log = logging.getLogger("rlbus.weightsync.blobs")

# below this size hashing inline is cheaper than a thread hop
_THREAD_HASH_MIN = 1 << 20


class WeightIntegrityError(RuntimeError):
    """A weight version failed verification (chunk checksum, blob checksum, state checksum or HMAC).

    The version is refused and nothing is applied: the caller keeps its current
    weights. ``version`` and ``chunk`` (a chunk name, or None) say what failed.
    """

    def __init__(self, message: str, *, version: int, chunk: str | None = None) -> None:
        super().__init__(message)
        self.version = version
        self.chunk = chunk


async def _digest_hex(data: memoryview, algo: Digest) -> str:
    if len(data) < _THREAD_HASH_MIN:
        return digest_hex(data, algo)
    return await asyncio.to_thread(digest_hex, data, algo)


async def write_chunks(
    store: BlobStore,
    run_id: str,
    version: int,
    kind: str,
    blob: bytes | bytearray | memoryview,
    chunk_bytes: int,
    parallel: int = 4,
    digest: Digest = "blake3",
) -> list[ChunkRef]:
    """Cut ``blob`` into chunks, hash each with ``digest``, store them (up to ``parallel`` at once);
    durable on return."""
    view = memoryview(blob).cast("B")
    sem = asyncio.Semaphore(parallel)

    async def one(i: int, off: int, size: int) -> ChunkRef:
        async with sem:
            part = view[off : off + size]
            ref = ChunkRef(
                name=chunk_name(run_id, version, kind, i), size=size, sha256=await _digest_hex(part, digest)
            )
            await store.put(ref.name, part, ref.sha256, digest)
            return ref

    parts = split(len(view), chunk_bytes)
    return list(await asyncio.gather(*(one(i, off, size) for i, (off, size) in enumerate(parts))))


async def copy_chunks(
    src: bytearray, dst: BlobStore, chunks: list[ChunkRef], parallel: int = 4, digest: Digest | None = None
) -> None:
    """Store already verified chunks (their concatenation is ``src``, their checksums ``digest`` hashes)
    under their own names in ``dst``."""
    view = memoryview(src)
    sem = asyncio.Semaphore(parallel)
    offsets = []
    pos = 0
    for c in chunks:
        offsets.append(pos)
        pos += c.size

    async def one(c: ChunkRef, off: int) -> None:
        async with sem:
            await dst.put(c.name, view[off : off + c.size], c.sha256, digest)

    await asyncio.gather(*(one(c, o) for c, o in zip(chunks, offsets, strict=True)))


async def read_chunks(store: BlobStore, manifest: WeightManifest, parallel: int = 4) -> bytearray:
    """Read every chunk of ``manifest`` into one buffer, verifying each chunk's digest and the root
    (with the manifest's ``digest`` algorithm).

    Raises :class:`WeightIntegrityError` naming the first bad chunk.
    """
    total = sum(c.size for c in manifest.chunks)
    if total != manifest.blob_nbytes:
        raise WeightIntegrityError(
            f"manifest of version {manifest.version} is inconsistent: chunks sum to {total} bytes, "
            f"blob_nbytes says {manifest.blob_nbytes}",
            version=manifest.version,
        )
    if root_digest(manifest.chunks, manifest.digest) != manifest.blob_sha256:
        raise WeightIntegrityError(
            f"manifest of version {manifest.version}: chunk digests do not match blob_sha256",
            version=manifest.version,
        )
    buf = bytearray(total)
    view = memoryview(buf)
    sem = asyncio.Semaphore(parallel)

    async def one(c: ChunkRef, off: int) -> None:
        async with sem:
            part = view[off : off + c.size]
            await store.read_into(c.name, part)
        got = await _digest_hex(part, manifest.digest)
        if got != c.sha256:
            raise WeightIntegrityError(
                f"chunk {c.name} of version {manifest.version} is corrupt: {manifest.digest} {got} != manifest "
                f"{c.sha256}; "
                "version refused, keep the current weights",
                version=manifest.version,
                chunk=c.name,
            )

    offsets = []
    pos = 0
    for c in manifest.chunks:
        offsets.append(pos)
        pos += c.size
    await asyncio.gather(*(one(c, o) for c, o in zip(manifest.chunks, offsets, strict=True)))
    return buf


def manifest_hmac(key: bytes, manifest: WeightManifest) -> str:
    """Hex HMAC-SHA256 of the manifest's msgpack encoding with ``hmac`` and ``store`` emptied.

    ``store`` is left out so a relay can re-home chunks without the key. ``digest`` is left out
    when it is the default ``sha256``: the body is then byte for byte what signers wrote before
    the field existed, so their signatures still verify; any other ``digest`` is signed.
    """
    fields = msgspec.to_builtins(msgspec.structs.replace(manifest, hmac="", store=""))
    if fields["digest"] == "sha256":
        del fields["digest"]
    body = msgspec.msgpack.encode(fields)
    return hmac_mod.new(key, body, hashlib.sha256).hexdigest()


def sign(key: bytes | None, manifest: WeightManifest) -> WeightManifest:
    """The manifest with its HMAC set (unchanged when no key is configured)."""
    if not key:
        return manifest
    return msgspec.structs.replace(manifest, hmac=manifest_hmac(key, manifest))


def verify_signature(key: bytes | None, manifest: WeightManifest) -> None:
    """Raise WeightIntegrityError unless the manifest carries a valid HMAC (no-op without a key)."""
    if not key:
        return
    if not manifest.hmac:
        raise WeightIntegrityError(
            f"version {manifest.version} is unsigned but a signing key is configured; refused",
            version=manifest.version,
        )
    if not hmac_mod.compare_digest(manifest_hmac(key, manifest), manifest.hmac):
        raise WeightIntegrityError(
            f"version {manifest.version} has an invalid HMAC signature (wrong key or tampered manifest); refused",
            version=manifest.version,
        )
