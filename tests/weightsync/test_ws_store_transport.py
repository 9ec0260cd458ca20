"""The store transport recovers by itself: sends retried across a server restart, the newest kept version
read back for resuming, corrupted versions skipped, missed announcements found by the re-check."""

from __future__ import annotations

import asyncio
import logging

import nats
import torch

from services.lib.weights.transport import StoreReceiver, StoreSender, make_receiver, make_sender
from services.runtime.natsd import EmbeddedNats
from services.runtime.weights_config import EncodingConfig, ObjStoreConfig, StoreTransportConfig
from tests.conftest import wait_for_async
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

RUN = "st"


def _config(**kw) -> StoreTransportConfig:
    kw.setdefault("encoding", EncodingConfig(anchor_every=1, chunk_bytes=64 * 1024))
    return StoreTransportConfig(**kw)


async def test_send_retries_across_a_server_restart_and_a_receiver_follows(tmp_path, caplog):
    server = EmbeddedNats(tmp_path / "nats", port=None)
    server.start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    cfg = _config(store=ObjStoreConfig(ack_timeout_s=2.0), retry_for_s=120, recheck_s=0.5)
    sender, receiver = make_sender(cfg, nc, RUN), make_receiver(cfg, nc, RUN)
    assert isinstance(sender, StoreSender)
    versions = aiter(receiver)
    try:
        await sender.start()
        s1 = make_state(0, scale=4)
        await sender.send(s1, 1)
        version, got = await asyncio.wait_for(anext(versions), 30)
        assert version == 1
        following = asyncio.ensure_future(anext(versions))

        server.stop()
        s2 = perturb(s1, 0.1, seed=1)
        with caplog.at_level(logging.WARNING, logger="rlbus.weightsync.transport"):
            sending = asyncio.create_task(sender.send(s2, 2))
            await wait_for_async(lambda: sender.retries > 0 or sending.done(), 60,
                                 "a failed try while the server is down")
            assert not sending.done(), "the send returned while the server was down"
            server.start()
            await asyncio.wait_for(sending, 120)  # returns once v2 is durable and announced
        assert any("publishing weights version 2 failed" in r.getMessage() for r in caplog.records)

        version, got = await asyncio.wait_for(following, 60)  # the receiver survived the restart
        assert version == 2 and receiver.version == 2
        assert_bit_identical(got, s2)
        kept = await sender.latest()
        assert kept is not None and kept[0] == 2
        assert_bit_identical(kept[1], s2)
    finally:
        await versions.aclose()
        await receiver.close()
        await sender.close()
        await nc.close()
        server.stop()


async def test_latest_reads_back_the_newest_kept_version(nc):
    sender = make_sender(_config(encoding=EncodingConfig(anchor_every=4, chunk_bytes=64 * 1024)), nc, RUN)
    await sender.start()
    assert await sender.latest() is None
    s1 = make_state(2, torch.bfloat16, scale=4)
    s2 = perturb(s1, 0.05, seed=3)  # a delta on v1
    await sender.send(s1, 1)
    await sender.send(s2, 2)
    restarted = make_sender(_config(), nc, RUN)  # a restarted trainer: a fresh sender reads the same
    for s in (sender, restarted):
        kept = await s.latest()
        assert kept is not None and kept[0] == 2
        assert_bit_identical(kept[1], s2)
    await sender.close()
    await restarted.close()


async def _corrupt_first_chunk(sender: StoreSender, version: int) -> None:
    manifest = await sender.publisher.index.manifest(version)
    assert manifest is not None
    victim = manifest.chunks[0]
    buf = bytearray(victim.size)
    await sender.publisher.store.read_into(victim.name, memoryview(buf))
    buf[victim.size // 2] ^= 0xFF
    await sender.publisher.store.put(victim.name, memoryview(buf), victim.sha256)


async def test_receiver_skips_a_corrupted_version_once_and_takes_the_next_good_one(nc, caplog):
    cfg = _config(recheck_s=0.05)
    sender, receiver = make_sender(cfg, nc, RUN), make_receiver(cfg, nc, RUN)
    assert isinstance(sender, StoreSender) and isinstance(receiver, StoreReceiver)
    await sender.start()
    rechecks = 0
    latest = receiver.subscriber.latest

    async def counted_latest():
        nonlocal rechecks
        rechecks += 1
        return await latest()

    receiver.subscriber.latest = counted_latest  # a spy: how often the re-check ran
    versions = aiter(receiver)
    s1 = make_state(4, scale=4)
    await sender.send(s1, 1)
    assert (await asyncio.wait_for(anext(versions), 30))[0] == 1

    # v2 is corrupted in the store before the receiver reads it (nothing iterates meanwhile)
    s2 = perturb(s1, 0.2, seed=5)
    await sender.send(s2, 2)
    await _corrupt_first_chunk(sender, 2)
    following = asyncio.ensure_future(anext(versions))
    await wait_for_async(lambda: receiver.refused == 1, 30, "version 2 to be refused")
    seen = rechecks
    await wait_for_async(lambda: rechecks >= seen + 5, 30, "more re-checks (each finds v2 again)")
    assert receiver.refused == 1 and receiver.version == 1 and not following.done()
    assert "blake3" in receiver.last_error
    refusals = [r for r in caplog.records if "refused weight version 2" in r.getMessage()]
    assert len(refusals) == 1, "a refused version is logged once"

    s3 = perturb(s2, 0.2, seed=6)
    await sender.send(s3, 3)
    version, got = await asyncio.wait_for(following, 30)
    assert version == 3 and receiver.refused == 1
    assert_bit_identical(got, s3)
    # the digests the applied versions were verified against are the announced manifests'; the refused
    # version has none
    announced = {v: await receiver.subscriber.index.manifest(v) for v in (1, 3)}
    assert receiver.digests == {v: f"{m.digest}:{m.state_sha256}" for v, m in announced.items()}
    await versions.aclose()
    await receiver.close()
    await sender.close()


async def test_recheck_finds_a_version_whose_announcement_the_watch_missed(nc, caplog):
    """A watch that delivers nothing (as one stuck after a server restart): the re-check reads the
    latest version within ``recheck_s`` and the receiver subscribes afresh."""
    cfg = _config(recheck_s=0.2)
    sender, receiver = make_sender(cfg, nc, RUN), make_receiver(cfg, nc, RUN)
    assert isinstance(receiver, StoreReceiver)
    await sender.start()
    watches = 0

    async def deaf_watch(include_current: bool = True):
        nonlocal watches
        watches += 1
        await asyncio.Event().wait()  # never announces anything
        yield  # pragma: no cover - makes this an async generator

    receiver.subscriber.watch = deaf_watch
    versions = aiter(receiver)
    following = asyncio.ensure_future(anext(versions))
    s1 = make_state(9, scale=2)
    with caplog.at_level(logging.INFO, logger="rlbus.weightsync.transport"):
        await sender.send(s1, 1)
        version, got = await asyncio.wait_for(following, 30)
        assert version == 1
        assert_bit_identical(got, s1)
        s2 = perturb(s1, 0.1, seed=10)
        await sender.send(s2, 2)
        version, got = await asyncio.wait_for(anext(versions), 30)
    assert version == 2
    assert_bit_identical(got, s2)
    assert watches >= 2  # re-subscribed after each miss
    assert any("did not announce" in r.getMessage() for r in caplog.records)
    await versions.aclose()
    await receiver.close()
    await sender.close()
