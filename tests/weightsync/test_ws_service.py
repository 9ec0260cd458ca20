"""The weightsync service on a real nats-server: relay to local engines, retention."""

from __future__ import annotations

import asyncio

import pytest
import torch

from proto.weights import WeightManifest
from services.lib.weights.client import WeightPublisher, WeightSubscriber
from services.lib.weights.objstore import ObjectStoreBlobs
from services.lib.weights.store import open_store
from services.runtime.weights_config import (
    EncodingConfig,
    FsStoreConfig,
    ObjStoreConfig,
    StoreTransportConfig,
)
from services.weightsync.config import RelayConfig, WeightsyncConfig
from services.weightsync.retention import versions_to_keep
from services.weightsync.service import WeightsyncService
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

RUN = "ws4"


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    states = [make_state(seed, torch.bfloat16, scale=8)]
    for i in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=seed + i))
    return states


async def test_relay_serves_four_engines_with_one_upstream_read(nc, tmp_path):
    local_store = FsStoreConfig(root=str(tmp_path / "node1"), fsync=False)
    config = WeightsyncConfig(
        run_id=RUN, relay=RelayConfig(scope="node1", store=local_store), keep_anchors=5, gc_upstream=False
    )
    service = WeightsyncService(nc, config)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop), name="weightsync")

    pub = WeightPublisher(
        nc, RUN, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=4, chunk_bytes=8192)
    )
    engines = [WeightSubscriber(nc, RUN, open_store(local_store), scope="node1") for _ in range(4)]
    states = _states(3)
    published: list[WeightManifest] = []
    for v, s in enumerate(states, start=1):
        published.append(await pub.publish(s, version=v))
        await asyncio.wait_for(service.wait_handled(v), 20)
        for e in engines:
            m = await e.latest()
            assert m is not None and m.version == v and m.store == "fs"
            assert_bit_identical(await e.fetch(m), s)

    upstream_bytes = sum(m.blob_nbytes for m in published)
    assert service.stats.versions_relayed == 3
    assert service.upstream_store.stats.bytes_read == upstream_bytes  # each version read once upstream
    assert service.stats.upstream_bytes == upstream_bytes
    for e in engines:
        assert e.store.stats.bytes_read == upstream_bytes  # every engine read from the local store
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_relay_joining_late_copies_the_chain(nc, tmp_path):
    pub = WeightPublisher(
        nc, RUN, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=10, chunk_bytes=8192)
    )
    states = _states(4, seed=3)
    for v, s in enumerate(states, start=1):
        await pub.publish(s, version=v)
    local_store = ObjStoreConfig()  # a second bucket on the same server: rlbus_weight_blobs_node2
    config = WeightsyncConfig(
        run_id=RUN, relay=RelayConfig(scope="node2", store=local_store), gc_upstream=False
    )
    service = WeightsyncService(nc, config)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop), name="weightsync")
    await asyncio.wait_for(service.wait_handled(4), 20)
    engine = WeightSubscriber(nc, RUN, open_store(local_store, nc, scope="node2"), scope="node2")
    m = await engine.latest()
    assert m is not None and m.version == 4 and m.kind == "delta"
    assert_bit_identical(await engine.fetch(m), states[-1])
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_retention_keeps_what_is_needed(nc, tmp_path):
    store_cfg = FsStoreConfig(root=str(tmp_path / "up"), fsync=False)
    config = WeightsyncConfig(run_id=RUN, keep_anchors=2, gc_upstream=True)
    service = WeightsyncService(nc, config, upstream=StoreTransportConfig(store=store_cfg))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop), name="weightsync")
    pub = WeightPublisher(
        nc, RUN, open_store(store_cfg), encoding=EncodingConfig(anchor_every=3, chunk_bytes=8192)
    )
    states = _states(8, seed=5)
    for v, s in enumerate(states, start=1):
        await pub.publish(s, version=v)
        await asyncio.wait_for(service.wait_handled(v), 20)
    # anchors at 1, 4, 7; keeping two anchors keeps 4..8 and deletes 1..3 (manifests and chunks)
    assert await service.upstream.versions() == [4, 5, 6, 7, 8]
    stored = {name.split("/")[1] for name in await service.upstream_store.list(f"{RUN}/")}
    assert stored == {f"v{v:010d}" for v in range(4, 9)}
    late = WeightSubscriber(nc, RUN, open_store(store_cfg))
    m = await late.latest()
    assert m is not None
    assert_bit_identical(await late.fetch(m), states[-1])
    # and the version before the newest anchor still rebuilds (its anchor 4 is kept)
    m5 = await late.index.manifest(5)
    assert m5 is not None
    assert_bit_identical(await WeightSubscriber(nc, RUN, open_store(store_cfg)).fetch(m5), states[4])
    stop.set()
    await asyncio.wait_for(task, 10)


def _m(version: int, kind: str, base: int | None) -> WeightManifest:
    return WeightManifest(
        version=version,
        kind=kind,
        base_version=base,
        anchor_version=version,
        tensors=[],
        full_nbytes=0,
        data_offset=0,
        chunks=[],
        blob_nbytes=0,
        blob_sha256="",
        state_sha256="",
        encoding="",
        store="fs",
    )


def test_retention_never_drops_the_chain_of_an_announced_version():
    ms = {
        1: _m(1, "full", None),
        2: _m(2, "delta", 1),
        3: _m(3, "delta", 2),
        4: _m(4, "full", None),
        5: _m(5, "full", None),
    }
    assert versions_to_keep(ms, keep_anchors=1) == {5}
    # v3 is still announced somewhere (e.g. a relay's latest): its chain 1, 2, 3 stays
    assert versions_to_keep(ms, keep_anchors=1, needed=[3]) == {1, 2, 3, 5}
    assert versions_to_keep(ms, keep_anchors=2) == {4, 5}


def test_config_selects_stores_and_checks_fields():
    import msgspec
    import pytest

    from services.runtime.weights_config import S3StoreConfig

    cfg = msgspec.convert(
        {
            "relay": {
                "scope": "node-a",
                "store": {"type": "s3", "bucket": "w", "endpoint_url": "http://h:9000"},
            }
        },
        WeightsyncConfig,
    )
    assert isinstance(cfg.relay.store, S3StoreConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"relay": {"scope": "r", "store": {"type": "ftp"}}}, WeightsyncConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"keep_anchors": 0}, WeightsyncConfig)


async def test_relay_scope_must_differ_from_the_trainers(nc):
    """A relay announcing under the trainer's own scope ([weights] scope) would feed itself: refused, naming
    the key."""
    from services.runtime.config import ConfigError

    config = WeightsyncConfig(run_id=RUN, relay=RelayConfig(scope="upstream"))
    with pytest.raises(ConfigError, match="services.weightsync.relay.scope"):
        WeightsyncService(nc, config, upstream=StoreTransportConfig(scope="upstream"))
