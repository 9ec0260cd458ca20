"""The RL loop on a local 3-node JetStream cluster with R3 streams (``[launcher] nats_cluster = 3``, what
``rlbus up --nats-cluster 3`` starts): the node leading the trajectory stream is SIGKILLed mid-run, the
services fail over to the other nodes, the run keeps stepping, the node is restarted and catches up, and
the accounting identity holds (published = trained + dropped + eval + pending, lost = 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proto import catalog, weights
from services.launcher.accounting import accounting
from services.launcher.supervisor import Supervisor
from services.runtime import bus
from tests.conftest import run_file, trainer_records, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def steps(metrics: Path) -> list[tuple[int, float]]:
    """(step, time) of every trainer step recorded in metrics.jsonl so far."""
    return [(r["step"], r["time"]) for r in trainer_records(metrics)]


def last_step(metrics: Path) -> int:
    return max((s for s, _ in steps(metrics)), default=0)


def step_after(metrics: Path, step: int, since: float) -> float | None:
    """Time of the first step beyond ``step`` recorded after ``since`` (wall clock)."""
    return next((t for s, t in steps(metrics) if s > step and t > since), None)


def test_loop_on_r3_cluster_survives_a_node_kill_and_loses_nothing(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="cluster",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   launcher={"nats_cluster": 3, "heartbeat_timeout_s": 60},
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1,
                            "checkpoint_every": 5, "group_timeout_s": 60,
                            "eval": {"prompts": 8}},
                   rollout={"max_tickets": 16})
    metrics = tmp_path / "run" / "metrics.jsonl"
    sup = Supervisor(str(cfg), quiet=True)
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        assert len(sup.nats_url.split(",")) == 3
        wait_for(lambda: last_step(metrics) >= 3, 400, "the run to reach step 3 on the cluster", interval=1.0)

        async def layout() -> tuple[dict[str, int], str]:
            nc = await bus.connect(sup.nats_section(), "test-layout")
            js = nc.jetstream()
            streams = [*catalog.STREAMS, *(f"KV_{k.bucket}" for k in catalog.KV_BUCKETS.values()),
                       f"KV_{weights.kv_bucket()}", f"OBJ_{weights.object_bucket()}"]
            out = {}
            for name in streams:
                info = await js.stream_info(name)
                out[name] = 1 + len(info.cluster.replicas or [])
            leader = (await js.stream_info("TRAJECTORIES")).cluster.leader
            await nc.close()
            return out, leader

        replicas, leader = asyncio.run(layout())
        assert set(replicas.values()) == {3}, replicas
        victim = next(i for i, n in enumerate(sup.nats.nodes) if leader.endswith(f"-n{i}"))
        step, t_kill = last_step(metrics), time.time()
        sup.nats.kill(victim)
        wait_for(lambda: step_after(metrics, step, t_kill), 300,
                 f"a step after SIGKILL of NATS node {victim} (the TRAJECTORIES leader)", interval=0.5)
        sup.nats.restart(victim)
        step, t_back = last_step(metrics), time.time()
        wait_for(lambda: step_after(metrics, step, t_back), 300, f"a step after node {victim} rejoined",
                 interval=0.5)
        sup.stop_services()

        async def check() -> dict:
            nc = await bus.connect(sup.nats_section(), "test-accounting")
            acc = await accounting(nc.jetstream(), "cluster")
            await nc.close()
            return acc

        acc = asyncio.run(check())
    finally:
        sup.stop()
    assert acc["lost"] == 0, acc
    assert acc["outcomes_without_trajectory"] == 0, acc
    assert acc["trained"] > 0, acc
    # the full identity: every trajectory exactly one outcome, pending, or refused by the trainer (dead-lettered)
    assert acc["multiple_outcomes"] == 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] + acc["dead_lettered"], acc


def test_rlbus_up_nats_cluster_starts_a_replicated_cluster(tmp_path):
    """``rlbus up --nats-cluster 3``: three nodes, the services get every URL, streams are R3; Ctrl-C stops
    it all."""
    cfg = run_file(tmp_path, "unused", run_id="upcluster", services={"echo": 1}, trainer={}, rollout=None)
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(cfg), "--nats-cluster", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    resolved = tmp_path / "run" / "config.resolved.json"
    try:
        wait_for(resolved.is_file, 120, "rlbus up to write its resolved config")
        tree = json.loads(resolved.read_text())
        assert len(tree["nats"]["url"].split(",")) == 3 and tree["nats"]["replicas"] == 3

        async def echo_stream_replicas() -> int:
            from services.launcher.auth import load_auth
            from services.runtime.config import NatsSection

            admin = load_auth(tmp_path / "run").for_role("admin")
            nc = await bus.connect(NatsSection(url=tree["nats"]["url"], user=admin.user, password=admin.password),
                                   "test")
            info = await nc.jetstream().stream_info("ECHO")
            await nc.close()
            return 1 + len(info.cluster.replicas or [])

        log = tmp_path / "run" / "logs" / "echo-0.log"  # services start once the streams are provisioned
        wait_for(lambda: log.is_file() and ": running" in log.read_text(), 120, "the echo service to run")
        assert asyncio.run(echo_stream_replicas()) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()[-3000:]
