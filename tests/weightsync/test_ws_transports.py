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

from services.weightsync.broadcast import BroadcastError
from services.weightsync.config import BroadcastConfig, TransportConfig
from services.weightsync.transport import make_receiver, make_sender
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
