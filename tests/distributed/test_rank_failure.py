"""A rank of a 2-rank trainer is SIGKILLed mid-run: the whole rank group stops, the launcher restarts
it, it resumes from its newest durable point and finishes the run with no trajectory lost.

Real processes throughout: the local supervisor (as `rlbus run` uses it) with an embedded
nats-server, a rollout, a judge and the trainer, whose rank 1 is its own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import nats
import pytest

from services.launcher.accounting import accounting
from services.launcher.supervisor import Supervisor
from services.runtime.natsd import EmbeddedNats
from services.trainer.ranks import rank_pid
from tests.conftest import run_file, wait_for

# the waits below are generous for a loaded machine; their sum is above the suite's default 600 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _steps(metrics) -> list[int]:
    if not metrics.is_file():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "trainer/version" in rec:
            out.append(rec["step"])
    return out


def test_killing_one_rank_restarts_the_group_and_loses_nothing(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="rankkill",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 2, "total_steps": 4, "max_staleness": 1, "checkpoint_every": 2,
                            "devices": {"world_size": 2, "device": "cpu"}, "group_timeout_s": 60},
                   rollout={"max_tickets": 8})
    sup = Supervisor(str(cfg), quiet=True)
    metrics = run_dir / "metrics.jsonl"
    try:
        sup.start()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait_for(lambda: len(_steps(metrics)) >= 2, 300, "the run to reach step 2", interval=0.5)
        first_rank0, victim = rank_pid(run_dir, 0), rank_pid(run_dir, 1)
        assert first_rank0 is not None and victim is not None
        step_before = max(_steps(metrics))
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        # 1. the whole group stops: rank 0 (the service process) exits non-zero
        crash = wait_for(lambda: next((e for e in sup.events if e["event"] == "exit" and e["child"] == "trainer-0"),
                                      None), 120, "rank 0 to stop after rank 1 was killed", interval=0.2)
        assert crash["code"] != 0, crash
        stop_s = crash["t"] - t_kill
        # 2. the launcher restarts the group: a new rank 0 and a new rank 1
        wait_for(lambda: rank_pid(run_dir, 0) not in (None, first_rank0) and rank_pid(run_dir, 1) not in (None, victim),
                 120, "a restarted rank group")
        # 3. it resumes and finishes the run
        wait_for(lambda: any(e["event"] == "exit" and e["child"] == "trainer-0" and e["code"] == 0
                             for e in sup.events), 420, "the restarted trainer to finish the run", interval=1.0)
    finally:
        sup.stop()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 4
    steps = _steps(metrics)
    assert any(s > step_before for s in steps)
    # resumed, not restarted from scratch: no step before the newest durable point is taken again
    assert steps.count(1) == 1, steps
    assert "rank 1 stopped" in (run_dir / "ranks" / "rank-1.log").read_text()  # the new rank 1 ended cleanly

    async def check():
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            acc = await accounting(nc.jetstream(), "rankkill")
            await nc.close()
        return acc

    acc = asyncio.run(check())
    assert acc["lost"] == 0, acc
    assert acc["outcomes_without_trajectory"] == 0, acc
    # the full identity: every trajectory exactly one outcome, pending, or refused by the trainer (dead-lettered)
    assert acc["multiple_outcomes"] == 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] + acc["dead_lettered"], acc
    print(json.dumps({"rank_group_stop_s": round(stop_s, 2), "steps": steps}))


def test_a_rank_dying_at_start_up_stops_rank_0_long_before_the_rank_timeout(tmp_path, loop_model_dir):
    """Rank 0 waiting for the group to form (``rank_timeout_s`` = 600 s) gives up as soon as rank 1 dies."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_dir": str(loop_model_dir), "steps": [1], "out": str(out),
                                "config": {"devices": {"world_size": 2, "device": "cpu", "num_threads": 1,
                                                       "rank_timeout_s": 600}}}))
    proc = subprocess.Popen([sys.executable, "-m", "tests.distributed.rank_script", str(spec)],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        victim = wait_for(lambda: rank_pid(out, 1), 120, "rank 1 to start")
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # the group's own timeout would be 600 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert f"trainer rank 1 (pid {victim}) exited with code -9" in stderr, stderr[-2000:]
