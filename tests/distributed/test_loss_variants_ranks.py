"""The loss variants (GSPO, CISPO, Dr. GRPO) and the mismatch corrections (IcePop, MIS masks) compute on 2 real
ranks (FSDP2 over gloo, started by the trainer's own RankGroup) what they compute on 1: the same loss and gradient
norm over the whole batch (each rank's micro-batches normalised by the whole batch's total)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, name: str, model_dir: Path, world_size: int, loss: dict) -> Path:
    out = tmp_path / name
    # micro-batches of 2 completions: each rank's share is cut into passes whose normaliser is the whole batch's
    config = {"devices": {"world_size": world_size, "num_threads": 1, "device": "cpu"},
              "optim": {"micro_batch_size": 2, "lr": 1e-3}, "sampling": {"max_new_tokens": 12}, "loss": loss}
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "config": config, "steps": [1], "out": str(out)}))
    r = subprocess.run([sys.executable, "-m", "tests.distributed.rank_script", str(spec)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text()[-2000:] for p in sorted((out / "ranks").glob("*.log"))) if out.exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + logs
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss", [
    {"type": "gspo", "is_mode": "icepop", "is_floor": 0.05, "is_cap": 20.0,
     "mismatch": {"mask": "geometric", "low": 0.1, "high": 10.0}},
    {"type": "cispo", "mismatch": {"mask": "token", "low": 0.2, "high": 5.0}},
    {"type": "dr_grpo", "mismatch": {"mask": "sequence", "low": 0.001, "high": 1000.0}},
], ids=lambda loss: loss["type"])
def test_two_ranks_compute_each_loss_variant_as_one_rank_does(tmp_path, loop_model_dir, loss):
    one = _run(tmp_path, "one", loop_model_dir, 1, loss)
    two = _run(tmp_path, "two", loop_model_dir, 2, loss)
    assert "rank 1 stopped" in (two / "ranks" / "rank-1.log").read_text()
    (a,), (b,) = (json.loads((o / "metrics.json").read_text()) for o in (one, two))
    assert a["losses/total"] != 0.0 and a["optim/grad_norm"] > 0.0  # the step really had a gradient
    assert abs(a["losses/total"] - b["losses/total"]) < 1e-5
    assert abs(a["optim/grad_norm"] - b["optim/grad_norm"]) < 1e-4 * max(1.0, a["optim/grad_norm"])
    # the behaviour logprobs of the made-up batch are far from the model's: the masks act on some tokens
    assert 0.0 < a["mismatch/masked_frac"] < 1.0 or loss["type"] == "dr_grpo", a
