"""Weight updates staged for vLLM's workers (services/lib/engine/staging.py): a staging directory too small
for the update (a real 1 MiB tmpfs, as a container's default /dev/shm is 64 MiB) fails with an error naming
the directory, the bytes needed and the bytes free, before a byte is written; a write that fails half-way
(a real file size limit in a child process) leaves no partial file behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.lib.engine import staging
from services.lib.engine.base import WeightUpdateError
from services.lib.engine.config import VllmEngineConfig

ROOT = Path(__file__).resolve().parents[2]




def test_an_update_larger_than_the_staging_dir_fails_naming_dir_sizes_and_leaves_nothing(tiny_tmpfs):
    tensors = {"w": torch.zeros(1 << 19), "b": torch.zeros(16)}  # 2 MiB of float32 into 1 MiB
    with pytest.raises(staging.StagingError) as err:
        staging.stage(tensors, str(tiny_tmpfs), "rlbus-weights-v1-")
    msg = str(err.value)
    assert str(tiny_tmpfs) in msg and "free" in msg and "needs 2.0 MiB" in msg and "staging_dir" in msg
    assert str(staging.needed_bytes(tensors)) in msg
    assert isinstance(err.value, WeightUpdateError)  # the engine's refusal type: the version is kept
    assert os.listdir(tiny_tmpfs) == []
    # one that fits is written, complete and readable
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    path = staging.stage(small, str(tiny_tmpfs), "rlbus-weights-v2-")
    from safetensors.torch import load_file

    assert torch.equal(load_file(path)["w"], small["w"]) and os.path.dirname(path) == str(tiny_tmpfs)
    assert os.path.getsize(path) <= staging.needed_bytes(small)  # the estimate bounds the file


def test_a_missing_staging_dir_is_named():
    with pytest.raises(staging.StagingError, match="staging dir /nonexistent/rlbus does not exist"):
        staging.stage({"w": torch.zeros(4)}, "/nonexistent/rlbus", "x-")


CHILD = """
import os, resource, signal, sys, torch
from services.lib.engine import staging
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    staging.stage({"w": torch.ones(1 << 18)}, sys.argv[1], "rlbus-weights-v3-")
except staging.StagingError as e:
    print("REFUSED", e)
"""


def test_a_write_failing_half_way_removes_its_partial_file(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED staging the weight update in " + str(tmp_path)), out.stdout + out.stderr
    assert os.listdir(tmp_path) == []  # the free-space check passed; the write failed; nothing was left


def test_the_default_staging_place():
    assert staging.staging_base("/data/stage") == "/data/stage"
    assert staging.staging_base("") in ("/dev/shm", staging.FALLBACK)
    assert VllmEngineConfig(staging_dir="/data/stage").staging_dir == "/data/stage"


def test_vllms_sleep_mode_gets_an_environment_without_expandable_segments():
    # a GPU trainer sets expandable_segments (services/trainer/devices.py); vLLM's sleep-mode allocator refuses it
    from services.lib.engine.vllm_procs import without_expandable_segments

    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert without_expandable_segments(env) == "expandable_segments:True" and env == {}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    assert without_expandable_segments(env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert without_expandable_segments(env) == "" and without_expandable_segments({}) == ""
