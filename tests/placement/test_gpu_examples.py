"""The GPU examples' placements, checked on this CPU host: ``rlbus config check`` passes on both, and each
process of the 8-GPU layout would start with its own GPUs and CPUs (what the launcher hands it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher.placement import Layout
from services.launcher.runfile import RunFile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["gpu.toml", "gpu_8.toml"])
def test_rlbus_config_check_passes_on_the_gpu_examples(name):
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "config", "check", str(EXAMPLES / name)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{name}: ok" in r.stdout


def test_the_8_gpu_example_gives_every_process_its_own_gpus():
    runfile = RunFile.load(EXAMPLES / "gpu_8.toml", env={})
    runfile.check()
    layout, host = Layout(runfile), set(range(96))

    def started(name: str, index: int) -> tuple[str, str, str]:
        env = layout.for_instance(name, index, {}, host).env
        return env["CUDA_VISIBLE_DEVICES"], env["RLBUS_PLACEMENT_CPUS"], env["OMP_NUM_THREADS"]

    assert started("trainer", 0) == ("0,1,2,3", "0-31", "32")  # 4 ranks, 8 CPUs each (split by the group)
    assert started("rollout", 0) == ("4,5", "48-63", "16")
    assert started("rollout", 1) == ("6,7", "64-79", "16")
    assert started("judge", 0) == ("", "32-47", "16")
    assert runfile.services.trainer.devices.world_size == 4
    assert runfile.services.rollout.engine.tensor_parallel_size == 2  # type: ignore[union-attr]
    assert layout.requests("trainer") == (4, 32) and layout.requests("rollout") == (2, 16)


def test_the_gpu_example_keeps_the_judge_and_weightsync_off_the_gpus():
    runfile = RunFile.load(EXAMPLES / "gpu.toml", env={})
    layout = Layout(runfile)
    host = set(range(16))
    assert layout.for_instance("trainer", 0, {}, host).env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert layout.for_instance("rollout", 0, {}, host).env["CUDA_VISIBLE_DEVICES"] == "2"
    for name in ("judge", "weightsync"):
        assert layout.for_instance(name, 0, {}, host).env["CUDA_VISIBLE_DEVICES"] == ""
