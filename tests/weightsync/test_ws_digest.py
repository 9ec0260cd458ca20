"""Chunk and state digests: BLAKE3 by default, SHA-256 manifests (from before the ``digest`` field) still read.

* a corrupt chunk of a BLAKE3 manifest is refused and the held version kept;
* an old-form manifest (no ``digest`` field, SHA-256 checksums, signed the old way) decodes as
  ``sha256``, its signature verifies and its chunks verify;
* a run that switches digest mid-chain rebuilds across both (SHA-256 anchor, BLAKE3 deltas);
* a signed BLAKE3 manifest relabelled ``sha256`` fails its signature;
* object-store chunks of a BLAKE3 manifest still carry the SHA-256 digest the object-store format
  requires (nats-py's ``ObjectStore.get`` checks it).
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest
import torch

from proto.weights import ChunkRef, TensorEntry, WeightManifest
from services.lib.weights.blobs import WeightIntegrityError
from services.lib.weights.client import WeightPublisher, WeightSubscriber
from services.lib.weights.store import open_store
from services.runtime.weights_config import EncodingConfig, FsStoreConfig, ObjStoreConfig
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

KEY = b"k" * 32
SHA256 = EncodingConfig(anchor_every=10, chunk_bytes=64 * 1024, digest="sha256")


class OldManifest(msgspec.Struct, kw_only=True):
    """``WeightManifest`` as it was before the ``digest`` field (field for field, in order)."""

    version: int
    kind: str
    base_version: int | None = None
    anchor_version: int
    tensors: list[TensorEntry]
    full_nbytes: int
    data_offset: int
    chunks: list[ChunkRef]
    blob_nbytes: int
    blob_sha256: str
    state_sha256: str
    encoding: str
    store: str
    aliases: dict[str, str] = {}
    hmac: str = ""


def old_sign(key: bytes, m: OldManifest) -> OldManifest:
    """The signature old publishers wrote: HMAC-SHA256 of the msgpack with hmac and store emptied."""
    body = msgspec.msgpack.encode(msgspec.structs.replace(m, hmac="", store=""))
    return msgspec.structs.replace(m, hmac=hmac.new(key, body, hashlib.sha256).hexdigest())


def fs(tmp_path) -> FsStoreConfig:
    return FsStoreConfig(root=str(tmp_path / "w"), fsync=False)


async def test_corrupt_chunk_refused_with_blake3(nc, tmp_path):
    a = make_state(1, torch.float32, scale=8)
    store = open_store(fs(tmp_path), nc)
    pub = WeightPublisher(nc, "dg1", store, encoding=EncodingConfig(anchor_every=10, chunk_bytes=4096))
    sub = WeightSubscriber(nc, "dg1", open_store(fs(tmp_path), nc))
    m1 = await pub.publish(a, version=1)
    assert m1.digest == "blake3"
    assert_bit_identical(await sub.fetch(m1), a)
    m2 = await pub.publish(perturb(a, 0.05, seed=9), version=2)
    victim = m2.chunks[-1]
    buf = bytearray(victim.size)
    await store.read_into(victim.name, memoryview(buf))
    buf[-1] ^= 0x01
    await store.put(victim.name, memoryview(buf), victim.sha256, "blake3")
    with pytest.raises(WeightIntegrityError, match="blake3") as err:
        await sub.fetch(m2)
    assert err.value.chunk == victim.name
    assert sub.version == 1
    assert_bit_identical(await sub.fetch(m1), a)


async def test_old_sha256_manifest_decodes_and_verifies(nc, tmp_path):
    state = make_state(2, torch.bfloat16, scale=16)
    store = open_store(fs(tmp_path), nc)
    pub = WeightPublisher(nc, "dg2", store, encoding=SHA256)
    new = await pub.publish(state, version=1)
    # the same version as an old publisher wrote it: no digest field, signed the old way
    fields = msgspec.to_builtins(new)
    del fields["digest"]
    old = old_sign(KEY, msgspec.convert(fields, OldManifest))
    wire = msgspec.msgpack.encode(old)
    assert b"digest" not in wire
    decoded = msgspec.msgpack.decode(wire, type=WeightManifest)
    assert decoded.digest == "sha256"
    assert len(decoded.chunks) > 1
    for c in decoded.chunks:  # the chunk checksums are plain SHA-256 of the stored bytes
        buf = bytearray(c.size)
        await store.read_into(c.name, memoryview(buf))
        assert hashlib.sha256(buf).hexdigest() == c.sha256
    sub = WeightSubscriber(nc, "dg2", open_store(fs(tmp_path), nc), hmac_key=KEY)
    assert_bit_identical(await sub.fetch(decoded), state)  # signature, chunks and root verify

    # and a corrupt chunk of the old manifest is still refused
    victim = decoded.chunks[0]
    buf = bytearray(victim.size)
    await store.read_into(victim.name, memoryview(buf))
    buf[0] ^= 0x80
    await store.put(victim.name, memoryview(buf), victim.sha256, "sha256")
    with pytest.raises(WeightIntegrityError, match="sha256") as err:
        await WeightSubscriber(nc, "dg2", open_store(fs(tmp_path), nc), hmac_key=KEY).fetch(decoded)
    assert err.value.chunk == victim.name


async def test_digest_switch_mid_chain(nc, tmp_path):
    states = [make_state(3, torch.float32, scale=4)]
    for i in range(1, 3):
        states.append(perturb(states[-1], 0.02, seed=i))
    pub = WeightPublisher(nc, "dg3", open_store(fs(tmp_path), nc), encoding=SHA256, hmac_key=KEY)
    follower = WeightSubscriber(nc, "dg3", open_store(fs(tmp_path), nc), hmac_key=KEY)
    m1 = await pub.publish(states[0], version=1)
    assert_bit_identical(await follower.fetch(m1), states[0])
    pub.encoding = msgspec.structs.replace(SHA256, digest="blake3")  # an upgraded trainer
    m2 = await pub.publish(states[1], version=2)
    m3 = await pub.publish(states[2], version=3)
    assert (m1.digest, m2.digest, m3.digest) == ("sha256", "blake3", "blake3")
    assert (m2.kind, m3.kind) == ("delta", "delta")
    assert_bit_identical(await follower.fetch(m2), states[1])  # delta on the held SHA-256 version
    late = WeightSubscriber(nc, "dg3", open_store(fs(tmp_path), nc), hmac_key=KEY)
    assert_bit_identical(await late.fetch(m3), states[2])  # SHA-256 anchor + BLAKE3 deltas


async def test_relabelled_digest_fails_signature(nc, tmp_path):
    pub = WeightPublisher(nc, "dg4", open_store(fs(tmp_path), nc), hmac_key=KEY)
    m = await pub.publish(make_state(4), version=1)
    assert m.digest == "blake3" and m.hmac
    forged = msgspec.structs.replace(m, digest="sha256")
    with pytest.raises(WeightIntegrityError, match="HMAC"):
        await WeightSubscriber(nc, "dg4", open_store(fs(tmp_path), nc), hmac_key=KEY).fetch(forged)


async def test_objstore_meta_keeps_sha256(nc):
    cfg = ObjStoreConfig(message_bytes=8192)
    pub = WeightPublisher(nc, "dg5", open_store(cfg, nc), encoding=EncodingConfig(chunk_bytes=32 * 1024))
    state = make_state(5, torch.float32, scale=4)
    m = await pub.publish(state, version=1)
    assert m.digest == "blake3"
    obj = await nc.jetstream().object_store(pub.store.bucket)
    for c in m.chunks:
        got = await obj.get(c.name)  # nats-py checks the meta's SHA-256 against the data
        assert len(got.data) == c.size
    assert_bit_identical(await WeightSubscriber(nc, "dg5", open_store(cfg, nc)).fetch(m), state)
    await pub.store.close()
