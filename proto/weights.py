"""Weight versions: manifests, announcements, and where they live on the bus.

Tensors never travel inside bus messages (docs/ARCHITECTURE.md, "How weights travel"): a version's
bytes sit as chunks in a blob store (the JetStream object store by default, S3,
or a shared directory) and the bus carries only its :class:`WeightManifest`.

Names, for a run ``<run>`` and a *scope* (``main`` is the trainer's own copy;
a relay re-publishes under its own scope, e.g. ``node-a``, for the engines near it):

* subject ``rlbus.<run>.weights.announce.<scope>`` (channel ``catalog.WEIGHT_ANNOUNCEMENTS``) —
  :class:`WeightAnnouncement`,
  published by the trainer's weight publisher (scope ``main``) or a weightsync
  relay (its scope) once the version is durably stored; consumed by rollout
  engines and relays. Core NATS (no stream): the KV entry below is the durable
  record, the subject only wakes listeners.
* KV bucket ``rlbus_weights_<scope>``, key ``<run>.latest`` — the newest
  announcement (same bytes as on the subject); key ``<run>.v.<version:010d>`` —
  the manifest of every version still stored (a late joiner walks from the
  newest anchor forward; retention deletes keys together with the blobs).
  Written by the publisher/relay, read by engines and relays.
* object-store bucket ``rlbus_weight_blobs_<scope>`` (when the store type is
  ``objstore``) — chunk objects named ``<run>/v<version:010d>/<kind>.<index:04d>``;
  S3 and filesystem stores use the same names under their prefix/root.
* subject ``rlbus.<run>.weights.broadcast.<scope>`` (channel ``catalog.WEIGHT_BROADCASTS``)
  and KV ``<run>.bcast.*`` —
  :class:`BroadcastGroup` / :class:`BroadcastReady`, rendezvous of the direct
  ``broadcast`` transport (published by the trainer, read by engines).
* subject ``rlbus.<run>.weights.vllm.<engine_id>`` (channel ``catalog.WEIGHT_VLLM_TRANSFER``,
  request/reply) and KV ``<run>.vllmxfer.engine.<engine_id>`` — :class:`VllmTransferRequest` /
  :class:`VllmTransferReply` / :class:`VllmTransferEngine`, the control plane of the ``vllm``
  transport (the trainer drives vLLM's weight-sync handshake on each engine; the data goes over
  NCCL or CUDA IPC straight into vLLM's workers).

Blob layout: a ``full`` version (anchor) is a safetensors file (any safetensors
reader opens the concatenated chunks); a ``delta`` version is a zstd frame of
per-tensor XOR updates (sparse or dense) against ``base_version`` (see
``services/lib/weights/encoding.py``).

Checksums, all with the manifest's ``digest`` algorithm (``blake3`` from publishers since
BLAKE3 replaced SHA-256 there; ``sha256``, the default, for manifests that do not name one, so
older messages decode and verify unchanged — the field names keep their historical ``sha256``):
``ChunkRef.sha256`` covers each chunk's stored bytes; ``blob_sha256`` is the digest of the
concatenated chunk digests (a one-level hash tree, so a reader verifies the whole without a
second pass over the data); ``state_sha256`` is the digest of the reconstructed tensor data (the
safetensors data section of the full layout), checked after a delta is applied. ``hmac`` is an
optional HMAC-SHA256 over the manifest (with ``hmac`` and ``store`` empty, and ``digest`` left out
when it is the default ``sha256``, so signatures made before the field existed still verify),
verified by engines that have the key; it covers ``digest``, so a forged downgrade is refused.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from proto.envelope import Envelope
from proto.subjects import check_run_id

FAMILY = "weights"

#: scope of the trainer's own (upstream) copy of the weights
MAIN_SCOPE = "main"

WEIGHTS_KV_PREFIX = "rlbus_weights"
WEIGHTS_OBJECT_PREFIX = "rlbus_weight_blobs"


def check_scope(scope: str) -> str:
    """A scope is one subject token and part of bucket names: ``[A-Za-z0-9_-]``."""
    check_run_id(scope)  # same alphabet and length as a run id
    return scope


def kv_bucket(scope: str = MAIN_SCOPE) -> str:
    """KV bucket holding announcements and manifests for one scope (all runs)."""
    return f"{WEIGHTS_KV_PREFIX}_{check_scope(scope)}"


def object_bucket(scope: str = MAIN_SCOPE) -> str:
    """Object-store bucket holding weight chunks for one scope (all runs)."""
    return f"{WEIGHTS_OBJECT_PREFIX}_{check_scope(scope)}"


def latest_key(run_id: str) -> str:
    """KV key of the newest announcement of a run."""
    return f"{check_run_id(run_id)}.latest"


def version_key(run_id: str, version: int) -> str:
    """KV key of one stored version's manifest."""
    return f"{check_run_id(run_id)}.v.{version:010d}"


def version_key_prefix(run_id: str) -> str:
    """Prefix of every version key of a run (``<run>.v.``)."""
    return f"{check_run_id(run_id)}.v."


def chunk_name(run_id: str, version: int, kind: str, index: int) -> str:
    """Store object name of one chunk: ``<run>/v<version:010d>/<kind>.<index:04d>``."""
    return f"{check_run_id(run_id)}/v{version:010d}/{kind}.{index:04d}"


def version_prefix(run_id: str, version: int) -> str:
    """Store name prefix of every chunk of one version."""
    return f"{check_run_id(run_id)}/v{version:010d}/"


class TensorEntry(msgspec.Struct, kw_only=True):
    """One tensor of the full layout."""

    name: str
    #: safetensors dtype string: F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL
    dtype: str
    shape: list[int]
    #: byte offset of the tensor's data inside the full (safetensors) blob
    offset: int
    nbytes: int
    #: delta versions only: number of elements that changed since base_version
    nnz: int = 0
    #: delta versions only: the XOR of the whole tensor is stored (not just the changed positions)
    dense: bool = False


class ChunkRef(msgspec.Struct, kw_only=True):
    """One stored chunk of a version's blob."""

    name: str
    size: int
    #: hex digest of the chunk's bytes, with the manifest's ``digest`` algorithm (the name is historical)
    sha256: str


class WeightManifest(msgspec.Struct, kw_only=True):
    """Everything an engine needs to fetch, verify and rebuild one weight version."""

    version: int
    kind: Literal["full", "delta"]
    #: delta: the version this delta applies to (the previous one); full: None
    base_version: int | None = None
    #: the newest full version at or before this one (itself for a full version)
    anchor_version: int
    #: tensors of the full layout, in blob order (a delta lists the same layout)
    tensors: list[TensorEntry]
    #: byte size of the full layout (safetensors file) this version rebuilds to
    full_nbytes: int
    #: offset of the tensor data section in the full layout (after the header)
    data_offset: int
    #: the stored blob: chunks in order; their concatenation is the blob
    chunks: list[ChunkRef]
    blob_nbytes: int
    #: ``digest`` over the concatenated chunk digests (hex)
    blob_sha256: str
    #: ``digest`` of the reconstructed tensor data section (hex)
    state_sha256: str
    #: hash of the chunk, blob and state checksums: "blake3" (what publishers write) or "sha256"
    #: (the default: manifests from before this field)
    digest: Literal["sha256", "blake3"] = "sha256"
    #: "safetensors" (full) or "xor-sparse-zstd-v1" (delta)
    encoding: str
    #: store type holding the chunks: objstore | s3 | fs
    store: str
    #: tied tensors published once: ``{alias name: canonical name}`` (the reader adds the alias back)
    aliases: dict[str, str] = {}
    #: hex HMAC-SHA256 of the manifest's msgpack with hmac="" and store="" (empty when unsigned);
    #: store is excluded so relays can re-home chunks without the key
    hmac: str = ""


class WeightAnnouncement(Envelope, kw_only=True, tag="weight_announcement"):
    """A new weight version is stored and ready (KV ``<run>.latest`` and the announce subject)."""

    policy_version: int
    scope: str = MAIN_SCOPE
    manifest: WeightManifest
    #: W3C traceparent of the span that sent this version (the trainer's step); engines link to it
    traceparent: str = ""


class BroadcastGroup(Envelope, kw_only=True, tag="weight_broadcast_group"):
    """Rendezvous of the direct ``broadcast`` transport (KV ``<run>.bcast.group``).

    Written by the trainer's broadcast sender (rank 0) before it waits for the
    engines; engines read it, claim a rank (KV ``<run>.bcast.<group_id>.rank.<i>``,
    created atomically) and join the TCPStore at ``master_addr:master_port``.
    """

    group_id: str
    master_addr: str
    master_port: int
    world_size: int
    #: gloo or nccl
    backend: str


class BroadcastReady(Envelope, kw_only=True, tag="weight_broadcast"):
    """The trainer is about to broadcast ``policy_version`` on the group ``group_id``.

    KV ``<run>.bcast.ready`` and subject ``rlbus.<run>.weights.broadcast.<scope>``:
    published by the broadcast sender, consumed by broadcast receivers (engines),
    which then join the collective. The data section of the full layout (no
    safetensors header; ``tensors[i].offset`` relative to its start) is sent in
    buckets of ``bucket_bytes``, followed by one 32-byte broadcast of its
    sha256 (all zeros when the sender's tensors are on a GPU and were not hashed).
    """

    policy_version: int
    group_id: str
    bucket_bytes: int
    tensors: list[TensorEntry]
    data_nbytes: int
    #: W3C traceparent of the span that sent this version (the trainer's step); engines link to it
    traceparent: str = ""


def broadcast_group_key(run_id: str) -> str:
    """KV key (scope's weights bucket) of the current :class:`BroadcastGroup`."""
    return f"{check_run_id(run_id)}.bcast.group"


def broadcast_ready_key(run_id: str) -> str:
    """KV key of the newest :class:`BroadcastReady`."""
    return f"{check_run_id(run_id)}.bcast.ready"


def broadcast_rank_key(run_id: str, group_id: str, rank: int) -> str:
    """KV key an engine creates to claim ``rank`` in group ``group_id``."""
    return f"{check_run_id(run_id)}.bcast.{check_scope(group_id)}.rank.{rank}"


class VllmTransferEngine(Envelope, kw_only=True, tag="weight_vllm_engine"):
    """A vLLM engine ready to receive weights through vLLM's weight-transfer API (KV
    ``<run>.vllmxfer.engine.<engine_id>`` of the scope's weights bucket): written by the rollout that
    hosts it, read by the trainer's ``vllm`` sender, which forms one group over every engine."""

    engine_id: str
    #: vLLM workers of the engine (tensor x pipeline parallel): the ranks it takes in the group
    workers: int
    #: GPU UUID of each worker ("cpu" where a worker has no GPU): the sender refuses a pair sharing a GPU
    gpus: list[str]
    #: the vLLM weight-transfer backend the engine was started with (nccl or ipc)
    backend: str


class VllmTransferRequest(Envelope, kw_only=True, tag="weight_vllm_request"):
    """One step of vLLM's weight-sync handshake, asked of one engine (subject
    ``rlbus.<run>.weights.vllm.<engine_id>``, request/reply): trainer -> rollout.

    ``op``: ``ping`` (answer: the engine is alive), ``init`` (join the transfer group: ``info`` is vLLM's worker init info), ``start``
    (pause generation, open the update), ``update`` (receive one batch: ``info`` is vLLM's update info,
    names/dtypes/shapes), ``finish`` (close the update, label ``policy_version``, resume), ``shutdown``
    (leave the group)."""

    op: Literal["ping", "init", "start", "update", "finish", "shutdown"]
    #: vLLM's init or update info for the step (plain names, numbers and lists)
    info: dict[str, Any] = {}
    policy_version: int = 0


class VllmTransferReply(Envelope, kw_only=True, tag="weight_vllm_reply"):
    """The engine's answer to a :class:`VllmTransferRequest`: rollout -> trainer."""

    ok: bool
    #: why the step failed ("" when ok)
    error: str = ""


def vllm_engine_key(run_id: str, engine_id: str) -> str:
    """KV key (scope's weights bucket) of one engine's :class:`VllmTransferEngine`."""
    return f"{check_run_id(run_id)}.vllmxfer.engine.{check_scope(engine_id)}"


def vllm_engine_prefix(run_id: str) -> str:
    """KV key prefix of every :class:`VllmTransferEngine` of ``run_id``."""
    return f"{check_run_id(run_id)}.vllmxfer.engine."
