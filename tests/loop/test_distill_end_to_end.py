"""On-policy distillation through a real `rlbus run` (trainer, rollout, judge and teacher as processes): a
teacher with the student's tokenizer (the same tiny model, warmed up longer) scores every training sample's
tokens; the trajectories carry its logprobs, token for token, and the trainer trains on every sample (none is
dropped for want of them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.tasks.tiny_model import ensure_tiny_model
from tests.conftest import recorded, run_file, trainer_records

pytestmark = pytest.mark.slow


def test_a_distillation_run_scores_every_sample_with_the_teacher(tmp_path, loop_model_dir):
    teacher = ensure_tiny_model(tmp_path / "teacher-cache", seed=0, warmup_steps=150)
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="distille2e",
                   services={"trainer": 1, "rollout": 1, "judge": 1, "teacher": 1},
                   trainer={"groups_per_step": 4, "total_steps": 3, "max_staleness": 1},
                   rollout={"max_tickets": 8},
                   extra=f'[distill]\nenabled = true\nkl_coef = 1.0\nreward_weight = 0.5\n\n'
                         f'[services.teacher]\nmodel = "{teacher}"\n')
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(trainer_records(run_dir / "metrics.jsonl")) == 3

    rec = recorded(run_dir, "distille2e")
    train = [t for t in rec.trajectories if not t.rollout.is_eval]
    assert train and not [t.rollout.error for t in train if t.rollout.error]
    for t in train:
        tokens = sum(len(turn.token_ids) for turn in t.rollout.turns)
        assert t.teacher_logprobs is not None and len(t.teacher_logprobs) == tokens
        assert all(lp <= 0.0 for lp in t.teacher_logprobs)
    # the teacher is not the student: its logprobs differ from the ones the student sampled with
    assert any(abs(lp - b) > 1e-3 for t in train for lp, b in zip(t.teacher_logprobs, t.rollout.turns[0].logprobs,
                                                                  strict=False))
    trained = [o for o in rec.outcomes if o.outcome == "trained"]
    dropped = [o for o in rec.outcomes if o.outcome == "dropped"]
    assert len(trained) == 3 * 4 * 4 and not [o for o in dropped if "teacher" in o.reason]
