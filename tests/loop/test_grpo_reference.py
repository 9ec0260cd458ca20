"""examples/grpo_reference.py, the algorithm in one file, runs: 20 GRPO steps on the test model, every
printed figure finite, and the saved weights differ from the ones it started from."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
STEPS = 20


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(shard)
    assert out, f"no safetensors in {model_dir}"
    return out


def test_reference_runs_20_steps_and_changes_the_weights(tmp_path, loop_model_dir):
    saved = tmp_path / "trained"
    command = [sys.executable, "examples/grpo_reference.py", "--model-dir", str(loop_model_dir),
               "--steps", str(STEPS), "--budget-s", "100000", "--eval-every", "10", "--log-every", "1",
               "--prompts-per-step", "8", "--group-size", "8", "--threads", "1", "--save-dir", str(saved)]
    r = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    summary, records = lines[-1], lines[:-1]

    steps = [rec for rec in records if "loss" in rec]
    assert [rec["step"] for rec in steps] == list(range(1, STEPS + 1))
    for rec in steps:
        for key in ("loss", "train_reward", "grad_norm"):
            assert math.isfinite(rec[key]), rec
        assert 0.0 <= rec["train_reward"] <= 1.0, rec
    assert any(rec["grad_norm"] > 0 for rec in steps), "no step had a learning signal"
    evals = [rec for rec in records if "eval_reward" in rec]
    assert [rec["step"] for rec in evals] == [0, 10, 20]
    assert all(0.0 <= rec["eval_reward"] <= 1.0 for rec in evals)

    assert summary["steps"] == STEPS
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["param_change"])
    assert summary["param_change"] > 0

    before, after = _weights(loop_model_dir), _weights(saved)
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed, "the saved model is the one it started from"
    delta = math.sqrt(sum(float((after[n].float() - before[n].float()).pow(2).sum()) for n in before))
    assert math.isclose(delta, summary["param_change"], rel_tol=1e-3), (delta, summary["param_change"])
