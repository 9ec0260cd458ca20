"""A checkpoint's commit (services/trainer/checkpoint.py): a step written twice (the final checkpoint after the
periodic one of the same step) ends as one whole directory, and a trainer stopped between the commit's two
renames still resumes from the step's earlier copy."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.trainer import checkpoint
from services.trainer.learner import Learner


class _Scheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 3}


LEARNER = SimpleNamespace(scheduler=_Scheduler())


def _write(root: Path, step: int, marker: str) -> Path:
    tmp = checkpoint.staging(root, step)
    tmp.mkdir()
    (tmp / "model.safetensors").write_text(marker)
    return checkpoint.commit(LEARNER, tmp, {"step": step, "marker": marker})


def test_a_step_written_again_is_replaced_whole(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first = _write(root, 120, "periodic")
    again = _write(root, 120, "final")
    assert first == again == root / "step-000120"
    assert (again / "model.safetensors").read_text() == "final"
    assert json.loads((again / "trainer_state.json").read_text())["marker"] == "final"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000120"]  # no copy left aside
    assert Learner.latest_checkpoint(root) == again


def test_stopped_between_the_two_renames_it_resumes_from_the_earlier_copy(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    _write(root, 120, "periodic")
    real = os.replace

    def stop_after_moving_aside(src, dst):  # the trainer dies right after the old copy moved aside
        real(src, dst)
        if Path(dst).name.startswith(".old-"):
            raise SystemExit("killed")

    monkeypatch.setattr(checkpoint.os, "replace", stop_after_moving_aside)
    with pytest.raises(SystemExit):
        _write(root, 120, "final")
    monkeypatch.undo()
    found = Learner.latest_checkpoint(root)
    assert found is not None and (found / "model.safetensors").read_text() == "periodic"
