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
from services.lib.weights.config import BroadcastConfig, TransportConfig
from services.lib.weights.transport import make_receiver, make_sender
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
    s1 = make_state(0, torch.bfloat16, scale=4)
    s2 = perturb(s1, 0.05, seed=1)
    for version, state in ((1, s1), (2, s2)):
        await sender.send(state, version)
        got_version, got = await asyncio.wait_for(receiver.receive(), 10)
        assert got_version == version and receiver.version == version
        assert_bit_identical(got, state)
    if raw["type"] == "inproc":
        # handed over, not copied
        assert got["embed.weight"].data_ptr() == s2["embed.weight"].data_ptr()
    await sender.close()
    await receiver.close()


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


async def test_broadcast_without_engines_times_out_and_says_so(nc):
    sender = make_sender(BroadcastConfig(world_size=2, backend="gloo", timeout_s=1.0), nc, "bc2")
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match="join|broadcast"):
        await sender.start()
    assert time.monotonic() - t0 < 30


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
