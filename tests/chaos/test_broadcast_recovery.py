"""The broadcast weight transport survives a dead engine: the trainer's send fails (bounded by
``timeout_s``), it re-forms the group, the surviving engine leaves the replaced group, the restarted
engine joins the new one, and training goes on. Trainer, 2 rollout engines and judge each their own
process, real gloo; nothing here is mocked. Then the trainer itself is killed: it restarts from its
checkpoint, forms a new group, and both engines follow it."""

from __future__ import annotations

import asyncio
import threading
import time

import nats
import pytest

from services.launcher.accounting import accounting
from services.launcher.supervisor import Supervisor
from services.runtime.natsd import EmbeddedNats
from tests.chaos.test_chaos import first_step_after, last_step
from tests.conftest import run_file, wait_for

pytestmark = pytest.mark.slow


def test_broadcast_run_survives_engine_and_trainer_kills(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    transport = {"type": "broadcast", "backend": "gloo", "timeout_s": 8}  # world_size: the launcher's (3)
    cfg = run_file(tmp_path, loop_model_dir, run_id="bcastchaos",
                   services={"trainer": 1, "rollout": 2, "judge": 1}, launcher={"max_restarts": 20}, common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 2, "total_steps": 100000, "max_staleness": 1,
                            "checkpoint_every": 2, "group_timeout_s": 30,
                            "eval": {"prompts": 4}},
                   rollout={"max_tickets": 8, "version_wait_s": 20}, weights=transport)
    metrics = run_dir / "metrics.jsonl"
    sup = Supervisor(str(cfg), quiet=True)
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait_for(lambda: last_step(metrics)[0] >= 3, 240, "the run to reach step 3", interval=0.5)
        for victim in ("rollout-1", "trainer-0"):
            step, _ = last_step(metrics)
            t_kill = time.time()
            assert sup.kill_child(victim) is not None
            wait_for(lambda step=step, t_kill=t_kill: first_step_after(metrics, step + 2, t_kill), 180,
                     f"two more steps after killing {victim} at step {step}", interval=0.5)
    finally:
        sup.stop()
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert "re-forming the broadcast group" in logs["trainer-0.log"]
    for engine in ("rollout-0.log", "rollout-1.log"):  # every engine joined more than one group
        assert logs[engine].count("joined broadcast group") >= 2, engine

    async def check():
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            acc = await accounting(nc.jetstream(), "bcastchaos")
            await nc.close()
        return acc

    acc = asyncio.run(check())
    assert acc["lost"] == 0, acc
