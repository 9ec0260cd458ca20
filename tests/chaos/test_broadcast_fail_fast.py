"""Fail-fast collectives on the broadcast transport (real gloo, a real engine process, a real learner): a send to
a killed engine fails at once with the peer's failure (not after the timeout), aborts its communicator, fails only
that version (``VersionNotDelivered``) while training goes on, and the next send forms a new group with the
restarted engine; no communicator is left open behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import nats
import pytest
import safetensors.torch
import torch
from nats.aio.client import Client as NATS

from services.lib.weights.broadcast import BroadcastError, _device, open_groups
from services.lib.weights.transport import VersionNotDelivered, make_receiver, make_sender
from services.runtime.weights_config import BroadcastConfig, ConfigError
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from tests.conftest import wait_for
from tests.distributed.rank_script import batch
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

REPO = Path(__file__).resolve().parents[2]


def _engine(nats_url: str, run: str, out: Path) -> subprocess.Popen[bytes]:
    """tests/weightsync/bcast_engine.py: joins the group and saves every version it receives, for ever."""
    return subprocess.Popen([sys.executable, str(REPO / "tests/weightsync/bcast_engine.py"), nats_url, run, str(out),
                             "1000"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _saved(path: Path) -> dict[str, torch.Tensor]:
    """What the engine saved at ``path``, once it has (it saves after receive() returned)."""
    def read() -> dict[str, torch.Tensor] | None:
        try:
            return safetensors.torch.load_file(str(path))
        except (FileNotFoundError, safetensors.SafetensorError):
            return None
    return wait_for(read, 120, f"the engine to save {path.name}")


def _trainer_cfg() -> TrainerConfig:
    return msgspec.convert({"devices": {"device": "cpu", "num_threads": 1}, "optim": {"micro_batch_size": 4}},
                           TrainerConfig)


def _train(learner: Learner, steps: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        steps.append(learner.step(batch(len(steps), vocab=12))["optim/grad_norm"])


async def test_a_send_to_a_killed_engine_fails_fast_and_training_goes_on(nats_url, tmp_path, loop_model_dir):
    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    run = "failfast"
    # reform_for_s = 0: a failed send is not retried, so the test sees the failure itself
    cfg = BroadcastConfig(world_size=2, backend="gloo", timeout_s=30, bucket_bytes=4096, reform_for_s=0)
    sender = make_sender(cfg, nc, run)
    engine = _engine(nats_url, run, tmp_path / "a")
    learner = Learner(_trainer_cfg(), loop_model_dir)
    steps: list[float] = []
    stop = threading.Event()
    trainer = threading.Thread(target=_train, args=(learner, steps, stop), name="training", daemon=True)
    engines = [engine]
    try:
        await sender.start()
        s1 = make_state(3, torch.float32, scale=8)
        await sender.send(s1, 1)
        assert_bit_identical(_saved(tmp_path / "a.v1.safetensors"), s1)
        trainer.start()
        engine.kill()  # the engine dies while the trainer is training
        engine.wait()
        old = sender.group
        assert old.state == "open" and open_groups() == 1

        s2 = perturb(s1, 0.3, seed=2)
        with pytest.raises(VersionNotDelivered) as failed:
            await sender.send(s2, 2)
        # it failed on the peer's death, not by running into timeout_s
        assert isinstance(failed.value, BroadcastError) and "failed:" in str(failed.value), failed.value
        assert "did not finish within" not in str(failed.value)
        assert old.state == "aborted" and old.pg is None  # its communicator aborted, not dropped
        assert open_groups() == 0
        after = len(steps)
        wait_for(lambda: len(steps) >= after + 2, 240, "two more training steps after the failed send")
        assert trainer.is_alive() and all(torch.isfinite(torch.tensor(steps)))

        # the restarted engine joins the group the next send forms, and gets that version
        engines.append(_engine(nats_url, run, tmp_path / "b"))
        s3 = perturb(s2, 0.3, seed=3)
        await sender.send(s3, 3)
        assert_bit_identical(_saved(tmp_path / "b.v3.safetensors"), s3)
        assert open_groups() == 1 and sender.group is not old
        await sender.close()
        assert sender.group.state == "shut down" and open_groups() == 0
    finally:
        stop.set()
        for e in engines:
            if e.poll() is None:
                e.kill()
                e.wait()
        if trainer.is_alive():
            await asyncio.to_thread(trainer.join, 300)
        await nc.close()


def test_nccl_takes_the_given_device_and_refuses_to_guess():
    with pytest.raises(ConfigError, match="device="):
        _device("nccl", None)
    with pytest.raises(ConfigError, match="backend is nccl but the weights live on cpu"):
        _device("nccl", "cpu")
    assert _device("gloo", "cuda:3") == torch.device("cpu")
    nccl = BroadcastConfig(world_size=2, backend="nccl")
    for make in (make_sender, make_receiver):  # at the trainer's / engine's start, not at the first version
        with pytest.raises(ConfigError, match="device="):
            make(nccl, NATS(), "r")
    if torch.cuda.device_count() > 1:  # the engine's GPU, whatever the thread's current device says
        assert _device("nccl", "cuda:1") == torch.device("cuda", 1)
