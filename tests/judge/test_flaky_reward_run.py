"""A run whose reward function hangs, raises, returns NaN or 2.0, or kills its process on some prompts trains
on the rest: each such sample is dropped with its reason, the judge is never restarted, and the accounting
identity holds. Separate processes (`rlbus run`), the task installed as a real `rlbus.tasks` plugin."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from proto import catalog
from proto.accounting import TrajectoryOutcome
from proto.metrics import MetricsReport
from services.launcher.accounting import accounting as run_accounting
from services.launcher.accounting import read_all, read_channel
from services.runtime.natsd import EmbeddedNats
from tests.conftest import run_file

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def install_plugin(where: Path) -> None:
    """The flaky task as an installed distribution declaring an ``rlbus.tasks`` entry point."""
    dist = where / "rlbus_flaky_task-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlbus-flaky-task\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlbus.tasks]\nflaky-addition = tests.judge.flaky_task:FlakyAddition\n")


@pytest.mark.timeout(1800)  # the shared tiny-model fixture alone took 552 s on a machine loaded to 13-16
def test_a_run_with_a_misbehaving_reward_trains_on_the_rest(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    install_plugin(tmp_path / "site")
    cfg = run_file(tmp_path, loop_model_dir, run_id="flaky",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   launcher={"heartbeat_timeout_s": 20.0},
                   task="flaky-addition", trainer={"groups_per_step": 4, "total_steps": 4, "max_staleness": 1},
                   rollout={"max_tickets": 8},
                   extra='[services.judge]\nuser_code = { workers = 2, timeout_s = 2.0 }\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run finished at step 4" in r.stderr
    # the judge was never killed for silence nor restarted: the hung rewards did not touch its event loop
    assert "no heartbeat" not in r.stderr and "restarting" not in r.stderr, r.stderr[-3000:]

    async def accounting():
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            trajectories = await read_channel(js, catalog.TRAJECTORIES, "flaky")
            outcomes = await read_channel(js, catalog.OUTCOMES, "flaky")
            reports = await read_all(js, "METRICS", "rlbus.flaky.metrics.judge", MetricsReport)
            acc = await run_accounting(js, "flaky")
            await nc.close()
            return trajectories, outcomes, reports, acc

    trajectories, outcomes, reports, acc = asyncio.run(accounting())
    held = acc["held_by_trainer_consumer"]
    assert acc["lost"] == 0, acc
    by_id: dict[str, list[TrajectoryOutcome]] = {}
    for o in outcomes:
        by_id.setdefault(o.trajectory_id, []).append(o)
    assert all(len(v) == 1 for v in by_id.values()), "a trajectory got two outcomes"
    trained = [o for o in outcomes if o.outcome == "trained"]
    dropped = [o for o in outcomes if o.outcome == "dropped"]
    assert trained, "nothing was trained on"
    # every misbehaviour was met: the judge published each such sample failed, with its reason
    prefix = "grading failed: flaky-addition.reward: reward() "
    errors = {t.msg_id: t.rollout.error for t in trajectories if t.rollout.error}
    for what in ("did not return within 2 s (its worker process was killed)", "raised ValueError: cannot grade",
                 "returned nan (not a finite number)", "returned 2, outside the task's range [0, 1]",
                 "killed its worker process ("):
        assert any(e.startswith(prefix + what) for e in errors.values()), (what, sorted(errors.values())[:10])
    # ... and the trainer dropped each training sample it reached with that reason, never trained on one
    # (failed eval samples are recorded as eval: they count 0 in the eval mean)
    settled = [o for o in outcomes if o.trajectory_id in errors and o.outcome != "eval"]
    assert settled and all(o.outcome == "dropped" for o in settled), settled[:5]  # (some went stale first)
    assert any(o.reason.startswith("rollout failed: " + prefix) for o in settled), settled[:5]
    failed_ids = set(errors)
    assert not failed_ids & {o.trajectory_id for o in trained}
    # counted in the judge's metrics
    assert max(rep.values.get("judge/failed_total", 0.0) for rep in reports) >= 5
    # accounting: published = trained + dropped + eval + pending
    published = {t.msg_id for t in trajectories}
    assert set(by_id) <= published
    pending = published - set(by_id)
    # what has no outcome is still held by the trainer's consumer: messages (groups) it holds or never got
    assert len(pending) == held, (len(pending), held)
    assert len(published) == len(trained) + len(dropped) + sum(o.outcome == "eval" for o in outcomes) + len(pending)
