"""`rlbus run examples/dataset.toml`, shortened: a run trained from a JSONL file and reward functions named by
import path (the shipped exact_match and the example's own module), with real services, accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.natsd import free_port
from tests.conftest import recorded

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, GROUPS, GROUP_SIZE, EVAL_PROMPTS = 6, 4, 4, 16


def test_dataset_example_trains_and_scores_with_named_rewards(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    short = {  # the example as shipped, but for the test model and a few steps
        "run.dir": run_dir, "launcher.nats_port": free_port(),
        "model.name": loop_model_dir,
        "services.trainer.total_steps": STEPS, "services.trainer.max_wall_s": 0,
        "services.trainer.groups_per_step": GROUPS, "services.trainer.group_size": GROUP_SIZE,
        "services.trainer.eval.every": 3, "services.trainer.eval.prompts": EVAL_PROMPTS,
        "services.trainer.eval.samples": 1, "services.trainer.checkpoint_every": 0,
    }
    command = [sys.executable, "-m", "services.launcher.cli", "run", "examples/dataset.toml"]
    for key, value in short.items():
        command += ["--set", f"{key}={json.dumps(str(value)) if isinstance(value, Path) else value}"]
    r = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run finished at step {STEPS}" in r.stderr

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/reward" in m] == [0, 3, 6]

    rec = recorded(run_dir, "dataset")
    trajectories, outcomes, ci = rec.trajectories, rec.outcomes, rec.trainer_consumer
    rows = {json.loads(line)["prompt"]: json.loads(line)["answer"]
            for line in (REPO / "examples/data/addition.jsonl").read_text().splitlines()}
    for t in trajectories:
        rollout = t.rollout
        assert rollout.error is None, rollout.error
        # prompts are the file's rows, their answers travel with them, and the spec the trainer named
        assert rows[rollout.prompt_text] == rollout.metadata["answer"]
        assert rollout.metadata["reward"] == "exact_match*1, examples.data.rewards:close*0.5"
        (score,) = t.scores
        assert score.error is None and "exact_match=" in score.explanation
        assert "examples.data.rewards:close=" in score.explanation
        completion = "".join(turn.text for turn in rollout.turns if turn.role == "assistant").strip()
        try:
            close = max(0.0, 1.0 - abs(int(completion) - int(rollout.metadata["answer"])) / 10)
        except ValueError:
            close = 0.0
        exact = float(completion == rollout.metadata["answer"])
        assert t.reward == pytest.approx((exact + 0.5 * close) / 1.5), (completion, score.explanation)
    # the example's own function made a difference: near misses earned part of the reward
    assert any(0.0 < t.reward < 1.0 for t in trajectories)
    # eval prompts are the held-out rows, never trained on
    eval_ids = {t.rollout.prompt_id for t in trajectories if t.rollout.is_eval}
    train_texts = {t.rollout.prompt_text for t in trajectories if not t.rollout.is_eval}
    assert eval_ids and all(i.startswith("dataset/eval/") for i in eval_ids)
    assert not {t.rollout.prompt_text for t in trajectories if t.rollout.is_eval} & train_texts

    # accounting: one outcome per trajectory, whatever has none is still held by the trainer's consumer
    by_id: dict[str, int] = {}
    for o in outcomes:
        by_id[o.trajectory_id] = by_id.get(o.trajectory_id, 0) + 1
    assert set(by_id.values()) == {1}
    assert sum(o.outcome == "trained" for o in outcomes) == STEPS * GROUPS * GROUP_SIZE
    assert sum(o.outcome == "eval" for o in outcomes) == 3 * EVAL_PROMPTS
    pending = {t.msg_id for t in trajectories} - set(by_id)
    assert len({p.rsplit("-s", 2)[0] for p in pending}) == ci.num_ack_pending + ci.num_pending  # a message per group
