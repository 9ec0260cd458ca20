"""A mixture of two environments through a real `rlbus run` (trainer, rollout, judge as processes): the rollout
and the judge build each ticket's task with its own [[task.mix]] options (the dataset's reward spec reaches the
judge), so both environments are generated, graded and trained; each is reported per step and per evaluation
round, and the trajectories carry their environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import recorded, run_file, trainer_records

pytestmark = pytest.mark.slow


def test_a_two_environment_mixture_runs_end_to_end(tmp_path, loop_model_dir):
    data = tmp_path / "doubles.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(10, 60)))
    mix = (f'[[task.mix]]\nname = "addition"\nweight = 1\n\n[[task.mix]]\nname = "dataset"\nweight = 1\n'
           f'options = {{ path = "{data}", max_new_tokens = 4, eval_fraction = 0.2, '
           f'reward = ["exact_match", "last_number"] }}\n')
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="mixe2e", services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 4, "total_steps": 4, "max_staleness": 1, "sampling": {"max_new_tokens": 0},
                            "eval": {"every": 2, "prompts": 3}},
                   rollout={"max_tickets": 8}, extra=mix)
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    steps = trainer_records(run_dir / "metrics.jsonl")
    assert len(steps) == 4
    assert all(sum(s.get(f"train/{e}/share", 0.0) for e in ("addition", "dataset")) == pytest.approx(1.0)
               for s in steps)
    assert any("train/addition/reward_mean" in s for s in steps) and any("train/dataset/reward_mean" in s for s in steps)
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "eval/reward" in line]
    assert [rnd["step"] for rnd in rounds] == [0, 2, 4]
    assert all("eval/addition/reward" in rnd and "eval/dataset/reward" in rnd for rnd in rounds)

    rec = recorded(run_dir, "mixe2e")
    by_env: dict[str, list] = {}
    for t in rec.trajectories:
        by_env.setdefault(t.rollout.task, []).append(t)
    assert set(by_env) == {"addition", "dataset"}
    # the judge graded each with its own task's grader; none failed (a judge that built the dataset task
    # without its [[task.mix]] options would refuse the reward spec the trainer put in its prompts)
    for env, trajs in by_env.items():
        assert all({s.grader for s in t.scores} == {f"{env}.reward"} for t in trajs), env
    failed = [t.rollout.error for t in rec.trajectories if t.rollout.error]
    assert not failed, failed[:3]
    # the dataset's completions are cut at its own budget
    assert all(len(t.rollout.turns[-1].token_ids) <= 4 for t in by_env["dataset"])
    trained = [o for o in rec.outcomes if o.outcome == "trained"]
    assert len(trained) == 4 * 4 * 4
