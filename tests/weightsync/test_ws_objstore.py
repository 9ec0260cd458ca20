"""Full weights through the JetStream object store and the bus (real nats-server)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.lib.weights.client import WeightIntegrityError, WeightPublisher, WeightSubscriber
from services.lib.weights.objstore import ObjectStoreBlobs
from services.runtime.weights_config import EncodingConfig, ObjStoreConfig
from tests.conftest import wait_for_async
from tests.weightsync.helpers import assert_bit_identical, make_state

RUN = "ws1"
FULL_ONLY = EncodingConfig(anchor_every=1, chunk_bytes=64 * 1024)


@pytest.mark.parametrize("fast_read", [True, False], ids=["rawpull", "nats-py"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_round_trip_bit_identical(nc, dtype, fast_read):
    state = make_state(0, dtype, scale=64)
    # small messages so each chunk spans several of them
    pub = WeightPublisher(
        nc, RUN, ObjectStoreBlobs(nc, ObjStoreConfig(message_bytes=4096)), encoding=FULL_ONLY
    )
    manifest = await pub.publish(state, version=1)
    assert manifest.kind == "full" and len(manifest.chunks) > 1

    sub = WeightSubscriber(nc, RUN, ObjectStoreBlobs(nc, ObjStoreConfig(fast_read=fast_read)))
    latest = await sub.latest()
    assert latest is not None and latest.version == 1
    got = await sub.fetch(latest)
    assert_bit_identical(got, state)
    assert sub.version == 1


async def test_corrupted_chunk_is_refused(nc):
    state = make_state(1, scale=64)
    store = ObjectStoreBlobs(nc)
    pub = WeightPublisher(nc, RUN, store, encoding=FULL_ONLY)
    good = await pub.publish(state, version=1)
    sub = WeightSubscriber(nc, RUN, ObjectStoreBlobs(nc))
    assert_bit_identical(await sub.fetch(good), state)

    bad_state = {k: v.clone() for k, v in state.items()}
    bad_state["embed.weight"][0, 0] += 1.0
    m2 = await pub.publish(bad_state, version=2)
    # overwrite one stored chunk with same-size bytes that differ in one byte
    victim = m2.chunks[1]
    buf = bytearray(victim.size)
    await store.read_into(victim.name, memoryview(buf))
    buf[victim.size // 2] ^= 0xFF
    await store.put(victim.name, memoryview(buf), victim.sha256)

    with pytest.raises(WeightIntegrityError) as err:
        await sub.fetch(m2)
    assert err.value.chunk == victim.name and err.value.version == 2
    assert victim.name in str(err.value)
    assert sub.version == 1  # still on the good version


async def test_latest_and_watch_see_new_versions(nc):
    pub = WeightPublisher(nc, RUN, ObjectStoreBlobs(nc), encoding=FULL_ONLY)
    sub = WeightSubscriber(nc, RUN, ObjectStoreBlobs(nc))
    assert await sub.latest() is None
    await pub.publish(make_state(0), version=1)

    seen: list[int] = []
    got_two = asyncio.Event()

    async def watch() -> None:
        async for ann in sub.watch():
            seen.append(ann.policy_version)
            if ann.policy_version == 3:
                got_two.set()
                return

    task = asyncio.create_task(watch(), name="watch")
    await pub.publish(make_state(1), version=2)
    await pub.publish(make_state(2), version=3)
    await asyncio.wait_for(got_two.wait(), 10)
    await task
    assert seen[0] in (1, 2) and seen[-1] == 3 and seen == sorted(set(seen))
    latest = await sub.latest()
    assert latest is not None and latest.version == 3


async def test_64mib_version_round_trip(nc):
    n = 16 * 1024 * 1024  # fp32 elements: 64 MiB
    state = {"w": torch.randn(n)}
    pub = WeightPublisher(nc, RUN, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=1))
    t0 = time.perf_counter()
    m = await pub.publish(state, version=1)
    t1 = time.perf_counter()
    sub = WeightSubscriber(nc, RUN, ObjectStoreBlobs(nc))
    got = await sub.fetch(m, copy=False)
    t2 = time.perf_counter()
    assert torch.equal(got["w"], state["w"])
    print(f"\n64 MiB: publish {t1 - t0:.2f}s, fetch+verify {t2 - t1:.2f}s ({64 / (t2 - t1):.0f} MiB/s)")


async def test_tied_weights_are_published_once(nc):
    state = make_state(5, scale=16)
    state["lm_head.weight"] = state["embed.weight"]  # tied, as in SmolLM2
    pub = WeightPublisher(nc, RUN, ObjectStoreBlobs(nc), encoding=FULL_ONLY)
    m = await pub.publish(state, version=1)
    assert m.aliases == {"lm_head.weight": "embed.weight"}
    assert all(t.name != "lm_head.weight" for t in m.tensors)
    got = await WeightSubscriber(nc, RUN, ObjectStoreBlobs(nc)).fetch(m)
    assert_bit_identical(got, state)


async def test_upload_ends_when_the_server_dies_mid_way_instead_of_hanging(tmp_path):
    """nats-py never times out a JetStream publish ack: a server killed mid-upload used to leave
    the publisher (the trainer) waiting forever. Now the upload either completes or fails with
    StoreError within the ack timeout, and the next try after the restart stores the blob intact."""
    import hashlib
    import os

    import nats

    from services.lib.weights.store import StoreError
    from services.runtime.natsd import EmbeddedNats, free_port

    server = EmbeddedNats(tmp_path / "nats", port=free_port())
    server.start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        store = ObjectStoreBlobs(nc, ObjStoreConfig(message_bytes=64 * 1024, publish_window=64, ack_timeout_s=3.0))
        await store.ensure()
        data = memoryview(os.urandom(32 * 1024 * 1024))
        sha = hashlib.sha256(data).hexdigest()
        put = asyncio.create_task(store.put("blob", data, sha))
        await wait_for_async(lambda: nc.stats["out_msgs"] > 100, 30, "the upload to be under way", interval=0.001)
        server.kill()
        # the server stays down until the client has seen it go (mid-upload: the publishes in flight are lost)
        await wait_for_async(lambda: nc.is_reconnecting, 60, "the client to notice the server is gone")
        server.start()
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(put, 60)
        except StoreError as err:
            assert "not acknowledged" in str(err) or "failed" in str(err)
        assert time.monotonic() - t0 < 30
        await store.put("blob", data, sha)  # the retry
        out = bytearray(len(data))
        await store.read_into("blob", memoryview(out))
        assert hashlib.sha256(out).hexdigest() == sha
    finally:
        await nc.close()
        server.stop()


async def test_dense_deltas_pause_delta_attempts_until_they_pay_again(nc, caplog):
    """A delta that comes out too dense is thrown away (an anchor goes out instead); encoding it cost
    ~7x a full encode, so the publisher stops trying for a doubling number of versions, and sparse
    changes get deltas again once the pause is over."""
    import logging

    from tests.weightsync.helpers import perturb

    pub = WeightPublisher(nc, "densedelta", ObjectStoreBlobs(nc),
                          encoding=EncodingConfig(anchor_every=100, chunk_bytes=64 * 1024))
    sub = WeightSubscriber(nc, "densedelta", ObjectStoreBlobs(nc))
    state, kinds, version = make_state(0), [], 0
    with caplog.at_level(logging.INFO, logger="rlbus.weightsync.client"):
        for seed, frac in [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 0.01), (6, 0.01), (7, 0.01), (8, 0.01)]:
            state, version = perturb(state, frac, seed=seed), version + 1
            manifest = await pub.publish(state, version)
            kinds.append(manifest.kind)
            assert_bit_identical(await sub.fetch(manifest), state)  # every version still rebuilds exactly
    # v2 and v4 tried a delta (too dense: anchors, pauses of 1 then 2); v3, v5, v6 did not try; v7 and v8 are deltas
    assert kinds == ["full"] * 6 + ["delta", "delta"]
    rejected = [r.getMessage() for r in caplog.records if "over the limit" in r.getMessage()]
    assert [m.split(":")[0] for m in rejected] == ["version 2", "version 4"]
    assert "next 1 versions" in rejected[0] and "next 2 versions" in rejected[1]


@pytest.mark.parametrize("fast_read", [True, False])
async def test_reads_leave_no_consumer_behind_once_closed(nc, fast_read):
    """A read's ephemeral consumer is deleted beside what follows the read, not before it returns; by the time
    the store is closed every one is gone (none piles up on the server over a long run)."""
    store = ObjectStoreBlobs(nc, ObjStoreConfig(message_bytes=4096))
    pub = WeightPublisher(nc, RUN, store, encoding=FULL_ONLY)
    states = {v: make_state(v, scale=16) for v in (1, 2, 3)}
    manifests = [await pub.publish(states[v], version=v) for v in states]
    reader = ObjectStoreBlobs(nc, ObjStoreConfig(fast_read=fast_read))
    sub = WeightSubscriber(nc, RUN, reader)
    for m in manifests:
        assert_bit_identical(await sub.fetch(m), states[m.version])
    await reader.close()
    info = await nc.jetstream().stream_info(reader.stream)
    assert info.state.consumer_count == 0
