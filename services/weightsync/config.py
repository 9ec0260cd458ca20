"""Configuration of weight stores, encoding, transports and the weightsync service (msgspec only).

Every pluggable part is chosen by a ``type`` field, so switching store or
transport is a config change, never a code change::

    store = {type = "s3", endpoint_url = "http://127.0.0.1:9000", bucket = "weights"}
    transport = {type = "broadcast", world_size = 3}
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MiB = 1024 * 1024


class ConfigError(ValueError):
    """A weightsync config value is out of range or inconsistent (the message names the field)."""


class ObjStoreConfig(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="objstore"
):
    """JetStream object store on the bus (the embedded default)."""

    #: bucket name; empty means ``rlbus_weight_blobs_<scope>``
    bucket: str = ""
    #: size of each NATS message a chunk is cut into (must not exceed the server's max_payload)
    message_bytes: Annotated[int, msgspec.Meta(ge=4096, le=64 * MiB)] = 512 * 1024
    #: JetStream storage of the bucket's stream: file (survives restarts) or memory
    storage: Literal["file", "memory"] = "file"
    #: stream replicas in a cluster
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    #: JetStream acks outstanding while uploading (pipelining)
    publish_window: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    #: messages requested per pull while downloading
    fetch_batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 256


class S3StoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="s3"):
    """Any S3-compatible endpoint through aioboto3 (multipart upload, ranged parallel download)."""

    bucket: str
    #: key prefix inside the bucket (chunks land at ``<prefix>/<run>/v<version>/...``)
    prefix: str = "rlbus"
    #: endpoint URL; empty means AWS's default for ``region``
    endpoint_url: str = ""
    region: str = "us-east-1"
    #: credentials; empty means the usual AWS chain (environment, profile, instance role)
    access_key_id: str = ""
    secret_access_key: str = ""
    #: path-style addressing (``endpoint/bucket/key``), needed by most self-hosted S3 servers
    path_style: bool = True
    #: multipart part size for uploads and range size for downloads
    part_bytes: Annotated[int, msgspec.Meta(ge=5 * MiB, le=512 * MiB)] = 8 * MiB
    #: concurrent part uploads / ranged GETs per blob
    parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    #: create the bucket if it does not exist
    create_bucket: bool = True


class FsStoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="fs"):
    """A shared filesystem directory (NFS-style); publish is write-to-temp then rename."""

    root: str
    #: fsync files and directories before the rename (durable on power loss; slower)
    fsync: bool = True


StoreConfig = ObjStoreConfig | S3StoreConfig | FsStoreConfig


class EncodingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the publisher encodes versions."""

    #: a full anchor every this many versions (1 = every version full); deltas in between
    anchor_every: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10
    #: dtype of published weights: bf16 casts floating tensors; native keeps the training dtype
    dtype: Literal["bf16", "native"] = "native"
    #: size of one stored chunk (each carries its own sha256)
    chunk_bytes: Annotated[int, msgspec.Meta(ge=64 * 1024, le=4096 * MiB)] = 32 * MiB
    #: zstd level of delta blobs
    zstd_level: Annotated[int, msgspec.Meta(ge=1, le=19)] = 3
    #: publish a full anchor instead of a delta when the delta would exceed this fraction of it
    max_delta_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
