"""A periodic checkpoint on a full disk (services/trainer/saves.py): skipped with a clear error, its partial
write removed (the space comes back), the last whole checkpoint kept and still the one to resume from, and the
learner goes on training; the final checkpoint raises. The disk is a real tmpfs sized to hold one checkpoint of
the tiny model but not two; the ledger's bookkeeping, not under test here, is a stand-in with its step."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from torch.distributed.checkpoint.api import CheckpointException

from services.trainer import devices, saves
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.step_input import StepInput
from tests.distributed.rank_script import batch


class _Ledger:  # the step and the trainer state a checkpoint holds
    def __init__(self) -> None:
        self.state = SimpleNamespace(step=0)

    def for_checkpoint(self) -> dict:
        return {"step": self.state.step}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def test_a_full_disk_skips_the_checkpoint_and_training_goes_on(tmp_path, loop_model_dir, caplog):
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    cfg = msgspec.convert({"devices": {"num_threads": 1, "device": "cpu"}}, TrainerConfig)
    learner = Learner(cfg, loop_model_dir, devices.resolve(cfg))
    ledger = _Ledger()
    # how big one checkpoint is, on an ordinary disk
    probe = tmp_path / "probe"
    assert await saves.checkpoint(learner, ledger, probe)
    one = _size(probe / "checkpoints")
    # a disk for one and a half
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(one * 3 // 2) // 4096 * 4096 + 4096}", "tmpfs",
                    str(disk)], check=True)
    try:
        ledger.state.step = 1
        assert await saves.checkpoint(learner, ledger, disk)
        root = disk / "checkpoints"
        free_after_first = saves.free_bytes(root)
        learner.step_input(StepInput.of(batch(1), cfg))  # a trained step in between
        ledger.state.step = 2
        with caplog.at_level(logging.ERROR, logger="rlbus.trainer"):
            assert not await saves.checkpoint(learner, ledger, disk)
        said = caplog.text
        assert "checkpoint of step 2 NOT written" in said and "resume from step-000001" in said, said
        # the partial write is gone and its space is back; the last whole checkpoint is still the one
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
        assert saves.free_bytes(root) == free_after_first
        assert Learner.latest_checkpoint(root) == root / "step-000001"
        # training goes on, and the final checkpoint does not skip: it raises
        metrics = learner.step_input(StepInput.of(batch(2), cfg))
        assert metrics["optim/grad_norm"] > 0
        ledger.state.step = 3
        with pytest.raises((Exception, CheckpointException)):  # what the writer raises on a short write
            await saves.checkpoint(learner, ledger, disk, required=True)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # its partial write removed
    finally:
        subprocess.run(["umount", str(disk)], check=True)
