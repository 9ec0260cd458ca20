"""A short `rlbus run` whose trainer is a group of 2 ranks (FSDP2 over gloo, bf16 mixed precision,
activation checkpointing): the loop advances a version per step, the final model and a sharded
checkpoint are written, rank 1 stops cleanly, and every trajectory is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from proto.accounting import TrajectoryOutcome
from tests.conftest import recorded, run_file

pytestmark = pytest.mark.slow


def test_a_two_rank_trainer_runs_the_loop(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="ranks2",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   model_keys={"dtype": "bfloat16"},  # FSDP's bf16 mixed precision, on the real loop
                   trainer={"groups_per_step": 2, "total_steps": 3, "max_staleness": 1, "checkpoint_every": 2,
                            "devices": {"world_size": 2, "device": "cpu"},
                            # and activation checkpointing
                            "optim": {"max_tokens_per_micro_batch": 64, "gradient_checkpointing": True}},
                   rollout={"max_tickets": 8})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    rank_log = (run_dir / "ranks" / "rank-1.log").read_text() if (run_dir / "ranks" / "rank-1.log").exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + rank_log[-2000:]
    assert "run finished at step 3" in r.stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 3 and summary["version"] == 3
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/version"] for m in metrics if "trainer/version" in m] == [1.0, 2.0, 3.0]
    # rank 1 was its own process, trained with rank 0 and stopped cleanly at the end
    assert "rank 1 of 2 ready on cpu" in rank_log and "rank 1 stopped" in rank_log

    # the final model is a Hugging Face directory; the checkpoints hold one DCP shard per rank
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    rec = recorded(run_dir, "ranks2")
    trajectories, outcomes, ci = rec.trajectories, rec.outcomes, rec.trainer_consumer
    by_id: dict[str, list[TrajectoryOutcome]] = {}
    for o in outcomes:
        by_id.setdefault(o.trajectory_id, []).append(o)
    assert all(len(v) == 1 for v in by_id.values()), "a trajectory got two outcomes"
    assert sum(o.outcome == "trained" for o in outcomes) == 3 * 2 * 4  # steps x groups x group size
    pending = {t.msg_id for t in trajectories} - set(by_id)
    assert len({p.rsplit("-s", 2)[0] for p in pending}) == ci.num_ack_pending + ci.num_pending  # a message per group  # nothing vanished
