"""bench/lora.py --loop's run files load as the launcher loads them, with the settings the bench says."""

from __future__ import annotations

import tomllib
from pathlib import Path

from bench.lora import loop_run_file
from services.launcher.runfile import RunFile
from services.runtime.weights_config import StoreTransportConfig


def test_loop_run_files_are_valid_run_files_with_the_benchs_settings(tmp_path: Path) -> None:
    full = RunFile.from_tree(tomllib.loads(loop_run_file("lb-full", tmp_path / "full", 60, 1e-4, None, "/c")))
    full.check()  # the layout's rules hold
    t = full.services.trainer
    assert (full.run.id, full.model.name, full.model.cache_dir, full.task.name) == (
        "lb-full", "tiny-addition", "/c", "addition")
    assert (t.total_steps, t.groups_per_step, t.group_size, t.optim.lr, t.sampling.max_new_tokens) == (60, 16, 8, 1e-4, 6)
    assert (t.eval.every, t.eval.prompts, t.eval.samples, t.devices.num_threads, t.checkpoint_every) == (0, 200, 2, 1, 0)
    assert t.lora is None
    assert isinstance(full.weights, StoreTransportConfig) and full.weights.encoding.anchor_every == 10
    lora = RunFile.from_tree(tomllib.loads(loop_run_file("lb-lora", tmp_path / "lora", 60, 1e-3,
                                                         {"r": 4, "alpha": 8.0}, "/c")))
    assert lora.services.trainer.lora is not None
    assert (lora.services.trainer.lora.r, lora.services.trainer.lora.alpha) == (4, 8.0)
    assert lora.services.trainer.optim.lr == 1e-3
