"""Elastic fleets: ``rlbus scale rollout=3`` against a running ``rlbus up`` adds two rollout workers that take
prompts at once; ``rlbus scale rollout=1`` stops two (gracefully: what they held is redelivered); the run keeps
stepping throughout and the accounting identity holds with nothing lost. Scaling the trainer is refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from services.launcher.accounting import accounting
from services.launcher.auth import load_auth
from services.launcher.status import members
from services.runtime import bus
from services.runtime.config import NatsSection
from services.runtime.natsd import EmbeddedNats
from tests.conftest import last_step, run_file, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "services.launcher.cli"]


def rollouts(run_dir: Path, run_id: str) -> dict[str, dict]:
    """Running rollout members (instance -> heartbeat), read as the run's admin user."""
    async def go() -> list[dict]:
        resolved = json.loads((run_dir / "config.resolved.json").read_text())
        admin = load_auth(run_dir).for_role("admin")
        nc = await bus.connect(NatsSection(url=resolved["nats"]["url"], user=admin.user, password=admin.password,
                                           max_reconnect_attempts=3), "test-members", first_attempts=1)
        try:
            return await members(nc.jetstream(), run_id)
        finally:
            await nc.close()

    return {m["instance"]: m for m in asyncio.run(go())
            if m["service"] == "rollout" and m["state"] == "running" and m["age_s"] < 15}


def scale(cfg: Path, *counts: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "scale", *counts, "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_scale_rollout_1_to_3_to_1_mid_run_loses_nothing(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="elastic", services={"trainer": 1, "rollout": 1, "judge": 1},
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 5.0},
                   trainer={"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1,
                            "checkpoint_every": 5, "group_timeout_s": 60,
                            "eval": {"prompts": 8}},
                   rollout={"max_tickets": 4, "report_every_s": 1.0})
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    up = subprocess.Popen([*CLI, "up", str(cfg)], cwd=ROOT, stdout=open(tmp_path / "up.log", "wb"),
                          stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: last_step(metrics) >= 2, 400, "the run to reach step 2", interval=1.0)

        r = scale(cfg, "rollout=3")
        assert r.returncode == 0 and "rollout=3" in r.stdout, r.stdout + r.stderr
        # the two new workers join and generate (their token counters rise above zero)
        wait_for(lambda: len([m for m in rollouts(run_dir, "elastic").values()
                              if m["metrics"].get("rollout/tokens_total", 0) > 0]) == 3,
                 300, "three rollout workers generating", interval=1.0)
        at_three = last_step(metrics)
        wait_for(lambda: last_step(metrics) >= at_three + 3, 300, "three steps with three workers", interval=1.0)

        r = scale(cfg, "rollout=1")
        assert r.returncode == 0 and "rollout=1" in r.stdout, r.stdout + r.stderr
        for i in (1, 2):  # each drains, stops and its process exits (the launcher sees the exit)
            wait_for(lambda i=i: f"rollout-{i} stopped (scaled down, exit code 0)" in (tmp_path / "up.log").read_text(),
                     120, f"rollout-{i} to drain and exit")
        wait_for(lambda: set(rollouts(run_dir, "elastic")) == {"rollout-0"}, 60, "one rollout worker left")
        at_one = last_step(metrics)
        wait_for(lambda: last_step(metrics) >= at_one + 2, 300, "two steps after scaling down", interval=1.0)

        refused = scale(cfg, "trainer=2")
        assert refused.returncode == 2 and "trainer cannot be scaled" in refused.stderr, refused.stderr
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(180)
    assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]

    async def check() -> dict:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            acc = await accounting(nc.jetstream(), "elastic")
            await nc.close()
        return acc

    acc = asyncio.run(check())
    assert acc["lost"] == 0, acc
    assert acc["outcomes_without_trajectory"] == 0, acc
    assert acc["trained"] > 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] - acc["multiple_outcomes"]
