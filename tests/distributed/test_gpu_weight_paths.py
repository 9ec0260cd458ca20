"""The parts of the GPU weight paths that run on a CPU: the broadcast's on-device digest (what NCCL
transfers are checked with instead of a host sha256), and the trainer's colocated hand-over."""

from __future__ import annotations

import asyncio
import hashlib

import torch

from services.lib.weights.broadcast import DeviceDigest, _hasher
from services.lib.weights.inproc import InprocReceiver, InprocSender
from services.runtime.weights_config import InprocConfig


def _digest(data: torch.Tensor, cuts: list[int]) -> bytes:
    h = DeviceDigest()
    lo = 0
    for hi in [*cuts, data.numel()]:
        h.update(data[lo:hi])
        lo = hi
    return h.digest()


def test_the_device_digest_does_not_depend_on_how_the_bytes_are_cut():
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    whole = _digest(data, [])
    assert len(whole) == 32
    assert _digest(data, [1, 4096, 50_000, 99_999]) == whole
    DeviceDigest._CHUNK, old = 777, DeviceDigest._CHUNK  # the widening chunk does not matter either
    try:
        assert _digest(data, [10_000]) == whole
    finally:
        DeviceDigest._CHUNK = old


def test_the_device_digest_notices_a_changed_or_moved_byte():
    data = torch.randint(0, 256, (65_536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    whole = _digest(data, [])
    flipped = data.clone()
    flipped[12_345] ^= 1
    assert _digest(flipped, []) != whole
    swapped = data.clone()
    i, j = 100, 40_000
    while swapped[i] == swapped[j]:
        j += 1
    swapped[i], swapped[j] = data[j].clone(), data[i].clone()
    assert _digest(swapped, []) != whole  # same bytes, other places: the position weights see it
    assert _digest(data[:-1], []) != whole  # a short transfer


def test_cuda_buckets_are_hashed_on_the_device_and_host_buckets_with_sha256():
    assert isinstance(_hasher(torch.device("cuda", 0)), DeviceDigest)  # choosing needs no GPU
    assert isinstance(_hasher(torch.device("cpu")), type(hashlib.sha256()))


def test_the_inproc_hand_over_keeps_tensors_on_their_device_without_a_host_copy():
    async def run():
        cfg = InprocConfig()
        sender, receiver = InprocSender(cfg, "colo"), InprocReceiver(cfg, "colo")
        weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
        await sender.send(weights, 1)
        version, got = await receiver.receive()
        return version, weights, got

    version, sent, got = asyncio.run(run())
    assert version == 1
    for k, t in sent.items():
        assert got[k].device == t.device and got[k].dtype == t.dtype and torch.equal(got[k], t)
        assert got[k].data_ptr() != t.data_ptr()  # a snapshot: the next step may change the trainer's tensor
