"""bench/gpu_check.sh, the GPU check run on a lent accelerator: on this CPU machine it must say plainly that
nothing was verified on a GPU (every GPU capability reported skipped, one JSON line each), and its CPU smoke run
(the same capabilities, small) must run every capability that can run on CPU, so the one device run it gets is
not spent finding a broken script. It never claims ``verified_gpu`` without a CUDA device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
CAPABILITIES = ["probe", "trainer", "fsdp", "digest", "refusal", "colocated", "vllm"]


def run(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict[str, dict], dict]:
    """The script's run, its capability lines by name, and its final summary line."""
    r = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHON": sys.executable})
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    return r, {line["capability"]: line for line in lines[:-1]}, lines[-1]


def test_without_a_gpu_every_gpu_capability_is_skipped_and_nothing_verified():
    assert not torch.cuda.is_available(), "this test is about a machine without CUDA"
    r, caps, summary = run(timeout=300)
    assert r.returncode == 0, r.stderr
    assert list(caps) == CAPABILITIES
    assert caps["probe"]["status"] == "ok" and caps["probe"]["result"]["cuda_available"] is False
    assert all(caps[c]["status"] == "skipped" and caps[c]["reason"] == "no CUDA device" for c in CAPABILITIES[1:])
    assert summary["verified_gpu"] is False and summary["device"] == "none" and summary["failed"] == []
    assert summary["skipped"] == CAPABILITIES[1:]
    assert "NOT verified" in r.stderr


def test_the_cpu_smoke_run_runs_what_a_cpu_can_and_claims_no_gpu():
    r, caps, summary = run("--device", "cpu", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(caps) == CAPABILITIES and summary["failed"] == []
    assert summary["verified_gpu"] is False and summary["device"] == "cpu"
    assert caps["trainer"]["result"]["models"]["tiny"]["bfloat16"]["loss_finite"]
    assert caps["fsdp"]["status"] == "ok" and caps["fsdp"]["result"]["round_trip_equal"]
    assert caps["fsdp"]["result"]["backend"] == "gloo"
    assert caps["colocated"]["status"] == "ok" and caps["colocated"]["result"]["steps"] == 3
    for gpu_only in ("digest", "refusal"):
        assert caps[gpu_only]["status"] == "skipped" and caps[gpu_only]["reason"].startswith("no GPU")
    assert caps["vllm"]["status"] == "skipped"  # not importable in this environment, or no GPU
    assert set(summary["skipped"]) == {"digest", "refusal", "vllm"}
