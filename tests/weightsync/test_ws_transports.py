"""Transports chosen by config alone: store, inproc, broadcast (2 real processes over gloo)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch

from services.lib.weights.broadcast import BroadcastError
from services.lib.weights.transport import make_receiver, make_sender
from services.runtime.weights_config import BroadcastConfig, InprocConfig, TransportConfig
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

REPO = Path(__file__).resolve().parents[2]


def _config(raw: dict) -> TransportConfig:
    return msgspec.convert(raw, TransportConfig)


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "store", "encoding": {"anchor_every": 2, "chunk_bytes": 65536}},
        {"type": "store", "store": {"type": "fs", "root": "{tmp}/w", "fsync": False}},
        {"type": "inproc", "channel": "c1"},
    ],
    ids=["objstore", "fs", "inproc"],
)
async def test_round_trip_by_config(nc, tmp_path, raw):
    raw = msgspec.json.decode(msgspec.json.encode(raw).replace(b"{tmp}", str(tmp_path).encode()))
    run = f"tr-{raw['type']}"
    sender, receiver = make_sender(_config(raw), nc, run), make_receiver(_config(raw), nc, run)
    await sender.start()
    await receiver.start()
    versions = aiter(receiver)
    s1 = make_state(0, torch.bfloat16, scale=4)
    s2 = perturb(s1, 0.05, seed=1)
    for version, state in ((1, s1), (2, s2)):
        await sender.send(state, version)
        got_version, got = await asyncio.wait_for(anext(versions), 10)
        assert got_version == version and receiver.version == version
        assert_bit_identical(got, state)
    assert receiver.refused == 0 and receiver.last_error == ""
    # the sender's caller may change its tensors once send returns (the learner's next step)
    expected = got["embed.weight"].clone()
    s2["embed.weight"].add_(1.0)
    assert torch.equal(got["embed.weight"], expected)
    await versions.aclose()
    await sender.close()
    await receiver.close()


async def test_inproc_without_snapshot_hands_the_tensors_over():
    cfg = InprocConfig(channel="c2", snapshot=False)
    sender, receiver = make_sender(cfg, None, "tr-hand"), make_receiver(cfg, None, "tr-hand")
    state = make_state(1)
    await sender.send(state, 1)
    version, got = await asyncio.wait_for(receiver.receive(), 10)
    assert version == 1
    assert got["embed.weight"].data_ptr() == state["embed.weight"].data_ptr()  # handed over, not copied


async def test_direct_transports_keep_nothing_to_resume_from(nc):
    assert await make_sender(InprocConfig(), None, "tr-keep").latest() is None
    assert await make_sender(BroadcastConfig(world_size=2), nc, "tr-keep").latest() is None


async def test_broadcast_between_two_processes(nc, nats_url, tmp_path):
    run = "bc1"
    out = tmp_path / "engine"
    engine = subprocess.Popen(
        [sys.executable, str(REPO / "tests/weightsync/bcast_engine.py"), nats_url, run, str(out), "2"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        sender = make_sender(
            BroadcastConfig(world_size=2, backend="gloo", timeout_s=30, bucket_bytes=4096), nc, run
        )
        await sender.start()
        s1 = make_state(3, torch.float32, scale=4)
        s2 = perturb(s1, 0.1, seed=4)
        await sender.send(s1, 1)
        await sender.send(s2, 2)
        assert await asyncio.wait_for(asyncio.to_thread(engine.wait), 60) == 0
        for v, s in ((1, s1), (2, s2)):
            assert_bit_identical(safetensors.torch.load_file(f"{out}.v{v}.safetensors"), s)
        await sender.close()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


async def test_broadcast_without_engines_times_out_and_says_so(nc, caplog):
    """Forming the group is re-tried (a new group each time) for ``reform_for_s``, then it raises."""
    sender = make_sender(BroadcastConfig(world_size=2, backend="gloo", timeout_s=1.0, reform_for_s=2.5), nc, "bc2")
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match="join|broadcast"):
        await sender.start()
    assert time.monotonic() - t0 < 30
    assert any("re-forming the broadcast group" in r.getMessage() for r in caplog.records)


async def test_broadcast_receiver_leaves_a_replaced_group_at_once_and_joins_the_new_one(nc):
    """A restarted trainer (or one that re-forms the group after a failure) announces a new group; an
    engine waiting for the old group's next version must notice at once, not after the timeout."""
    cfg = BroadcastConfig(world_size=2, backend="gloo", timeout_s=60, bucket_bytes=4096)
    run = "bc3"
    old, receiver = make_sender(cfg, nc, run), make_receiver(cfg, nc, run)
    await asyncio.gather(old.start(), receiver.start())
    s1 = make_state(5, torch.float32, scale=2)
    _, (version, got) = await asyncio.gather(old.send(s1, 1), receiver.receive())
    assert version == 1
    assert_bit_identical(got, s1)

    new = make_sender(cfg, nc, run)
    joining = asyncio.create_task(new.start())  # waits for the engine to join the new group
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match="replaced"):
        await asyncio.wait_for(receiver.receive(), 30)
    assert time.monotonic() - t0 < 10  # noticed from the announcement, far below timeout_s
    await receiver.close()

    again = make_receiver(cfg, nc, run)
    await asyncio.gather(again.start(), joining)
    s2 = perturb(s1, 0.2, seed=6)
    _, (version, got) = await asyncio.gather(new.send(s2, 2), again.receive())
    assert version == 2
    assert_bit_identical(got, s2)
    await again.close()
    await new.close()


async def test_broadcast_send_reforms_the_group_after_an_engine_died_and_a_following_engine_rejoins(
        nc, nats_url, tmp_path, caplog):
    """An engine process takes v1 and exits (it died); the next send fails on it, withdraws the group,
    forms a new one and sends again; an engine following with ``async for`` (its restart) joins the new
    group and gets v2 — no retry loop in the caller."""
    cfg = BroadcastConfig(world_size=2, backend="gloo", timeout_s=10, bucket_bytes=4096, reform_for_s=60)
    run = "bc4"
    engine = subprocess.Popen(
        [sys.executable, str(REPO / "tests/weightsync/bcast_engine.py"), nats_url, run, str(tmp_path / "e"), "1"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    sender = make_sender(cfg, nc, run)
    follower = make_receiver(cfg, nc, run)
    versions = aiter(follower)
    try:
        await sender.start()
        s1 = make_state(7, torch.float32, scale=2)
        await sender.send(s1, 1)
        assert await asyncio.wait_for(asyncio.to_thread(engine.wait), 60) == 0  # took v1, then gone
        first_group = sender.group_id
        following = asyncio.ensure_future(anext(versions))
        s2 = perturb(s1, 0.2, seed=8)
        await asyncio.wait_for(sender.send(s2, 2), 90)
        version, got = await asyncio.wait_for(following, 30)
        assert version == 2 and follower.version == 2
        assert_bit_identical(got, s2)
        assert sender.group_id != first_group
        assert any("re-forming the broadcast group" in r.getMessage() for r in caplog.records)
    finally:
        await versions.aclose()
        await follower.close()
        await sender.close()
        if engine.poll() is None:
            engine.kill()
            engine.wait()
