"""Configuration of weight stores, encoding and transports (msgspec only): the run file's ``[weights]``.

Every pluggable part is chosen by a ``type`` field, so switching store or transport is a config change,
never a code change. One section, ``[weights]``, for the whole run (the trainer sends with it, engines and
weightsync read with it)::

    [weights]
    type = "store"                    # the default: anchors + deltas in a blob store, engines pull
    store = { type = "s3", endpoint_url = "http://127.0.0.1:9000", bucket = "weights" }

    [weights]
    type = "broadcast"                # world_size: set by rlbus run/up from the rollouts they start

    [weights]
    type = "inproc"                   # trainer and rollout colocated ("trainer+rollout")

    [weights]
    type = "vllm"                     # straight into vLLM's workers through vLLM's own weight-transfer API
    backend = "nccl"                  # disaggregated, same fabric; "ipc" when colocated on one GPU
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

MiB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent (the message names the key).

    The one configuration error of rlbus (services.runtime.config re-exports it)."""


class ObjStoreConfig(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="objstore"
):
    """JetStream object store on the bus (the embedded default)."""

    #: bucket name; empty means ``rlbus_weight_blobs_<scope>``
    bucket: str = ""
    #: size of each NATS message a chunk is cut into; capped to the server's max_payload (the embedded
    #: server and deploy/nats allow 8 MiB; a stock server 1 MB). Big messages cut the server's per-message
    #: work: 7 MiB pulls 1.1-1.3x faster than 512 KiB here (bench/objstore_messages.py, BENCHMARKS.md)
    message_bytes: Annotated[int, msgspec.Meta(ge=4096, le=64 * MiB)] = 7 * MiB
    #: JetStream storage of the bucket's stream: file (survives restarts) or memory
    storage: Literal["file", "memory"] = "file"
    #: stream replicas in a cluster
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    #: JetStream acks outstanding while uploading (pipelining)
    publish_window: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    #: an upload whose chunk messages are not all acknowledged by then fails with StoreError (and is
    #: retried by the publisher's caller); nats-py never times out these acks by itself
    ack_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    #: messages requested per pull while downloading
    fetch_batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 256
    #: read chunks over an extra plain connection that writes payloads in place (falls back to
    #: nats-py automatically under TLS or nkey/JWT auth)
    fast_read: bool = True


class S3StoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="s3"):
    """Any S3-compatible endpoint through aioboto3 (multipart upload, ranged parallel download)."""

    #: the S3 bucket chunks are stored in
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

    #: the directory versions are written under (shared by the trainer and every engine that reads them)
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
    #: size of one stored chunk (each carries its own digest)
    chunk_bytes: Annotated[int, msgspec.Meta(ge=64 * 1024, le=4096 * MiB)] = 16 * MiB
    #: zstd level of delta blobs
    zstd_level: Annotated[int, msgspec.Meta(ge=1, le=19)] = 3
    #: publish a full anchor instead of a delta when the delta would exceed this fraction of it
    max_delta_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    #: hash of the chunk, blob and state checksums in published manifests: blake3 (several times
    #: faster to verify than sha256 on one core) or sha256; readers verify either, by the manifest
    digest: Literal["blake3", "sha256"] = "blake3"


class StoreTransportConfig(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="store"
):
    """Weights through a blob store + announcements on the bus (the default; engines pull on their own clock)."""

    #: where chunks are stored, chosen by ``type``: objstore (the bus's JetStream object store, the default),
    #: s3 (any S3 API server), fs (a shared filesystem)
    store: StoreConfig = msgspec.field(default_factory=ObjStoreConfig)
    #: scope to publish to (trainer: ``main``) or read from (engines: ``main`` or their relay's scope)
    scope: str = "main"
    encoding: EncodingConfig = msgspec.field(default_factory=EncodingConfig)
    #: environment variable holding the hex HMAC key (sign when publishing, verify when reading)
    hmac_key_env: str = ""
    #: chunks transferred concurrently
    parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    #: sender: seconds a send keeps retrying (back-off 0.5 s doubling to 10 s) while the bus or store is
    #: away (a restarting server) before it raises; integrity and ordering errors raise at once
    retry_for_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    #: receiver: seconds without an announcement after which the latest version is re-read from KV
    #: (catches an announcement the watch missed, e.g. across a server restart)
    recheck_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0


class BroadcastConfig(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="broadcast"
):
    """A torch.distributed group between the trainer (rank 0) and engines; rendezvous over the bus."""

    #: trainer + engines of the first group: every one must join before the first send completes. An
    #: engine that comes later asks for a rank and the next send forms a larger group; a group that fails
    #: (an engine left or died) is formed again at this size, and engines beyond it ask again
    #: ``rlbus run``/``rlbus up`` set it to 1 + the rollout engines they start (0, the default: theirs to
    #: set); set it yourself only where no launcher starts the run (a cluster's manifests)
    world_size: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    #: gloo (CPU tensors), nccl (CUDA tensors), or auto (nccl when CUDA is available)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    #: address engines reach the trainer's TCPStore at
    master_addr: str = "127.0.0.1"
    #: 0 picks a free port
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: bytes per broadcast call (bounds the extra memory on every rank)
    bucket_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 64 * MiB
    #: any join or broadcast that takes longer fails with BroadcastError (never a silent hang)
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: dtype of sent weights, as for the store transport
    dtype: Literal["bf16", "native"] = "native"
    scope: str = "main"
    #: sender: seconds a failed send keeps re-forming the group (engines that died rejoin when they
    #: restart) and sending again before it raises BroadcastError
    reform_for_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0


class InprocConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="inproc"):
    """Colocated trainer and engine in one process: tensors are handed over, never copied through the bus."""

    #: name of the in-process channel (one per trainer/engine pair)
    channel: str = "default"
    #: clone tensors on send, so the sender may change its tensors (the next optimiser step) as soon as
    #: send returns; false hands the very tensors over (the engine must apply before they change)
    snapshot: bool = True


class VllmTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="vllm"):
    """Weights straight into each vLLM worker's parameters through vLLM's own weight-transfer API
    (``weight_transfer_config``, :mod:`services.lib.weights.vllm_transfer`); rollouts must use the ``vllm``
    engine, and the trainer's process needs vLLM importable too (it runs vLLM's trainer-side engine).

    ``nccl``: disaggregated on one fabric; trainer rank 0 broadcasts, every worker of every engine receives
    on its own GPU; the trainer's GPU must not be any engine's (refused at start-up). ``ipc``: colocated
    (``trainer+rollout`` in one process, one GPU): CUDA IPC handles of the trainer's tensors. Anything across
    nodes without a shared fabric: keep ``type = "store"``. ``gloo``: ``nccl``'s handshake and layerwise reload
    with the bytes on a gloo group, for engines on CPU."""

    #: nccl (disaggregated, distinct GPUs), ipc (colocated on the trainer's GPU, one process), or gloo (the
    #: nccl handshake with the bytes on a gloo group: CPU engines, the vLLM CPU build)
    backend: Literal["nccl", "ipc", "gloo"] = "nccl"
    #: nccl/gloo: vLLM engines the trainer waits for before forming the group; ``rlbus run``/``up`` set it to
    #: the rollouts they start (0, the default: theirs to set); ipc: ignored (the one colocated engine)
    engines: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    #: nccl/gloo: address the engines' workers reach the trainer's rendezvous at
    master_addr: str = "127.0.0.1"
    #: nccl/gloo: 0 picks a free port
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: bytes per packed bucket (vLLM's ``packed_buffer_size_bytes``): bounds the extra device memory on
    #: the trainer and on every worker to ``bucket_bytes * num_buffers``
    bucket_bytes: Annotated[int, msgspec.Meta(ge=1 * MiB, le=64 * 1024 * MiB)] = 256 * MiB
    #: buckets in flight (vLLM's ``packed_num_buffers``: one packs while another is on the wire)
    num_buffers: Annotated[int, msgspec.Meta(ge=1, le=8)] = 2
    #: any rendezvous, control request or transfer that takes longer fails the send (never a silent hang)
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: sender: seconds a failed send keeps forming the group again (engines that did not answer are dropped
    #: from it; restarted ones register anew) before it raises; 0: one try
    reform_for_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    #: dtype of sent weights: bf16 casts floating tensors; native keeps the training dtype
    dtype: Literal["bf16", "native"] = "native"
    #: scope of the engine registry (KV bucket of the scope)
    scope: str = "main"
    #: ipc: name of the in-process channel the colocated engine registers under
    channel: str = "default"


TransportConfig = StoreTransportConfig | BroadcastConfig | InprocConfig | VllmTransferConfig


def load_hmac_key(env_var: str) -> bytes | None:
    """The HMAC key from hex in ``$env_var`` (None when ``env_var`` is empty)."""
    if not env_var:
        return None
    value = os.environ.get(env_var, "")
    if not value:
        raise ConfigError(
            f"hmac_key_env names ${env_var}, which is not set; export the hex key or clear the field"
        )
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ConfigError(f"${env_var} must hold the HMAC key in hex") from None
