"""``rlbus scale rollout=2`` with the broadcast transport: the new engine asks for a rank, the trainer's next
send forms a larger group, both engines take the following versions and the run keeps stepping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import last_step, run_file, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "services.launcher.cli"]


def test_scale_rollout_up_with_the_broadcast_transport_grows_the_group(tmp_path, loop_model_dir):
    bc = {"type": "broadcast", "world_size": 2, "backend": "gloo", "timeout_s": 30}
    cfg = run_file(tmp_path, loop_model_dir, run_id="bcscale", services={"trainer": 1, "rollout": 1, "judge": 1},
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 5.0},
                   trainer={"groups_per_step": 2, "total_steps": 100000, "max_staleness": 1},
                   rollout={"max_tickets": 4}, weights=bc)
    run_dir = tmp_path / "run"
    metrics, logs = run_dir / "metrics.jsonl", run_dir / "logs"
    up = subprocess.Popen([*CLI, "up", str(cfg)], cwd=ROOT, stdout=open(tmp_path / "up.log", "wb"),
                          stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: last_step(metrics) >= 2, 400, "the run to reach step 2", interval=1.0)
        r = subprocess.run([*CLI, "scale", "rollout=2", "--config", str(cfg)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "rollout=2" in r.stdout, r.stdout + r.stderr
        wait_for(lambda: "forming a larger one" in (logs / "trainer-0.log").read_text(), 300,
                 "the trainer to form a larger broadcast group", interval=1.0)
        wait_for(lambda: (logs / "rollout-1.log").is_file()
                 and "joined broadcast group" in (logs / "rollout-1.log").read_text(), 300,
                 "the new engine to join the group", interval=1.0)
        at = last_step(metrics)
        wait_for(lambda: last_step(metrics) >= at + 2, 300, "two steps with both engines", interval=1.0)
        assert "to 2 engines" in (logs / "trainer-0.log").read_text()  # a version broadcast to both
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(180)
    assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
