"""bench/gpu_check.sh, the GPU check run on a lent accelerator: on this CPU machine it must say plainly that
nothing was verified on a GPU, and its CPU smoke run (the same parts, small) must produce every part's figures
in its final JSON line, so the one device run it gets is not spent finding a broken script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_without_a_gpu_it_verifies_nothing_and_says_so():
    assert not torch.cuda.is_available(), "this test is about a machine without CUDA"
    r = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    figures = last_json(r.stdout)
    assert figures["verified_gpu"] is False and figures["reason"] == "no CUDA device" and figures["parts"] == {}
    assert "NOT verified" in r.stderr


def test_the_cpu_smoke_run_produces_every_part():
    r = subprocess.run([str(SCRIPT), "--device", "cpu"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = last_json(r.stdout)
    assert figures["failed"] == [] and figures["verified_gpu"] is False and figures["device"] == "cpu"
    trainer = figures["parts"]["trainer"]["models"]["tiny"]
    assert trainer["bfloat16"]["loss_finite"] and trainer["float32"]["train_tokens_per_s"] > 0
    engine = figures["parts"]["engine_tiny"]
    assert engine["device"] == "cpu" and engine["engine_tok_s"] > 0 and engine["useful_tokens"] > 0
