"""Weight chunks in any S3-compatible bucket through aioboto3.

Uploads above ``part_bytes`` go as multipart uploads with ``parallel`` parts in
flight; downloads are ranged GETs of ``part_bytes`` each, ``parallel`` at once,
written straight into the caller's buffer. Path-style addressing and
``request_checksum_calculation="when_required"`` keep self-hosted servers
(moto, s3rver, MinIO, Ceph) working (buckets by path; not all accept botocore's default checksums).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aioboto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from services.lib.weights.store import BlobNotFound, StoreError, StoreStats
from services.runtime.weights_config import S3StoreConfig

log = logging.getLogger("rlbus.weightsync.s3")


def _missing(err: ClientError) -> bool:
    code = str(err.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


class S3Blobs:
    """:class:`~services.lib.weights.store.BlobStore` on an S3 bucket (keys ``<prefix>/<name>``)."""

    kind = "s3"

    def __init__(self, config: S3StoreConfig) -> None:
        self.config = config
        self.stats = StoreStats()
        self._stack = contextlib.AsyncExitStack()
        self._client = None
        self._sem = asyncio.Semaphore(config.parallel)

    def _key(self, name: str) -> str:
        return f"{self.config.prefix.strip('/')}/{name}" if self.config.prefix.strip("/") else name

    async def _s3(self):
        if self._client is None:
            session = aioboto3.Session(
                aws_access_key_id=self.config.access_key_id or None,
                aws_secret_access_key=self.config.secret_access_key or None,
                region_name=self.config.region,
            )
            boto_cfg = BotoConfig(
                s3={"addressing_style": "path" if self.config.path_style else "auto"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                max_pool_connections=max(10, 2 * self.config.parallel),
                retries={"max_attempts": 5, "mode": "standard"},
            )
            self._client = await self._stack.enter_async_context(
                session.client("s3", endpoint_url=self.config.endpoint_url or None, config=boto_cfg)
            )
        return self._client

    async def ensure(self) -> None:
        s3 = await self._s3()
        try:
            await s3.head_bucket(Bucket=self.config.bucket)
        except ClientError as err:
            if not _missing(err) or not self.config.create_bucket:
                raise StoreError(f"S3 bucket {self.config.bucket!r} is not usable: {err}") from err
            try:
                await s3.create_bucket(Bucket=self.config.bucket)
            except ClientError as cerr:
                code = cerr.response.get("Error", {}).get("Code", "")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise StoreError(f"cannot create S3 bucket {self.config.bucket!r}: {cerr}") from cerr

    async def put(self, name: str, data: memoryview, digest: str, algo: str | None = None) -> None:
        # the checksum rides along as object metadata (x-amz-meta-<algo>) for tools; nothing reads it back
        meta = {algo: digest} if algo else {}
        s3 = await self._s3()
        key, size, part = self._key(name), len(data), self.config.part_bytes
        try:
            if size <= part:
                async with self._sem:
                    await s3.put_object(
                        Bucket=self.config.bucket, Key=key, Body=bytes(data), Metadata=meta
                    )
            else:
                await self._multipart(s3, key, data, meta)
        except ClientError as err:
            raise StoreError(f"S3 put of {key!r} into bucket {self.config.bucket!r} failed: {err}") from err
        self.stats.bytes_written += size
        self.stats.blobs_written += 1

    async def _multipart(self, s3, key: str, data: memoryview, meta: dict[str, str]) -> None:
        part = self.config.part_bytes
        up = await s3.create_multipart_upload(Bucket=self.config.bucket, Key=key, Metadata=meta)
        upload_id = up["UploadId"]

        async def one(number: int, off: int) -> dict[str, object]:
            async with self._sem:
                resp = await s3.upload_part(
                    Bucket=self.config.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=bytes(data[off : off + part]),
                )
            return {"ETag": resp["ETag"], "PartNumber": number}

        try:
            parts = await asyncio.gather(
                *(one(i + 1, off) for i, off in enumerate(range(0, len(data), part)))
            )
            await s3.complete_multipart_upload(
                Bucket=self.config.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
            )
        except (Exception, asyncio.CancelledError):
            with contextlib.suppress(ClientError):
                await s3.abort_multipart_upload(Bucket=self.config.bucket, Key=key, UploadId=upload_id)
            raise

    async def read_into(self, name: str, out: memoryview) -> None:
        s3 = await self._s3()
        key = self._key(name)
        try:
            head = await s3.head_object(Bucket=self.config.bucket, Key=key)
        except ClientError as err:
            if _missing(err):
                raise BlobNotFound(f"S3 object {key!r} not found in bucket {self.config.bucket!r}") from None
            raise StoreError(f"S3 head of {key!r} failed: {err}") from err
        size = int(head["ContentLength"])
        if size != len(out):
            raise StoreError(f"S3 object {key!r} has {size} bytes, the manifest says {len(out)}")
        part = self.config.part_bytes

        async def one(off: int) -> None:
            end = min(off + part, size)
            async with self._sem:
                resp = await s3.get_object(Bucket=self.config.bucket, Key=key, Range=f"bytes={off}-{end - 1}")
                pos = off
                body = resp["Body"]
                async with body:
                    while piece := await body.read(1 << 20):
                        n = len(piece)
                        if pos + n > end:
                            raise StoreError(f"S3 range {off}-{end - 1} of {key!r} returned too many bytes")
                        out[pos : pos + n] = piece
                        pos += n
            if pos != end:
                raise StoreError(f"S3 range {off}-{end - 1} of {key!r} returned {pos - off} bytes")

        try:
            await asyncio.gather(*(one(off) for off in range(0, size, part)))
        except ClientError as err:
            raise StoreError(f"S3 get of {key!r} failed: {err}") from err
        self.stats.bytes_read += size
        self.stats.blobs_read += 1

    async def delete(self, name: str) -> None:
        s3 = await self._s3()
        try:
            await s3.delete_object(Bucket=self.config.bucket, Key=self._key(name))
        except ClientError as err:
            if not _missing(err):
                raise StoreError(f"S3 delete of {self._key(name)!r} failed: {err}") from err
            return
        self.stats.blobs_deleted += 1

    async def list(self, prefix: str) -> list[str]:
        s3 = await self._s3()
        full = self._key(prefix)
        strip = len(self._key(""))
        names: list[str] = []
        paginator = s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.config.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                names.append(obj["Key"][strip:])
        return sorted(names)

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None
