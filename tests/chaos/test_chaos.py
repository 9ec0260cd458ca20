"""Chaos: a tiny run with every service its own process; random SIGKILLs of every role (trainer, rollout,
judge, weightsync, sandbox and NATS) and of the trainer's rank 1 (the trainer runs 2 ranks on the CPU: a
dead rank stops its whole group, which the launcher restarts).

Asserts that steps keep advancing after each recovery, that the accounting identity
holds (every trajectory trained, dropped with a reason, evaluated, or still pending;
none lost) and that the final model loads. Writes its figures to
``$RLBUS_FIGURES_DIR/chaos.json`` when that is set (BENCHMARKS.md quotes them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import threading
import time
import uuid
from pathlib import Path

import nats
import pytest

from services.launcher.accounting import accounting
from services.launcher.supervisor import Supervisor
from services.sandbox.overlay import mounts_under
from services.trainer.ranks import rank_pid
from tests.conftest import run_file, trainer_records, wait_for

pytestmark = pytest.mark.slow

CHAOS_S = float(os.environ.get("RLBUS_CHAOS_S", "100"))


def last_step(metrics: Path) -> tuple[int, float]:
    """(newest step, time of the last step record) so far."""
    records = trainer_records(metrics)
    return (max(r["step"] for r in records), records[-1]["time"]) if records else (0, 0.0)


def first_step_after(metrics: Path, step: int, since: float) -> float | None:
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "trainer/version" in rec and rec["step"] > step and rec["time"] > since:
            return rec["time"]
    return None


ROLES = ["trainer", "trainer-rank", "nats", "rollout", "judge", "weightsync", "sandbox"]


def sandbox_instances_ready(run_dir: Path) -> int:
    """How many sandbox instances have come up in this run (each logs "ready" once it has reaped the
    sandboxes its dead predecessors left)."""
    log = run_dir / "logs" / "sandbox-0.log"
    return log.read_text(errors="replace").count("ready (bwrap") if log.is_file() else 0


def live_rank(run_dir: Path, rank: int) -> int | None:
    """The pid of the trainer's ``rank`` while that process runs (None: not started, or the pid file is a
    dead predecessor's)."""
    pid = rank_pid(run_dir, rank)
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return None
    return pid if state != "Z" and b"services.trainer.ranks" in cmdline else None


def sandbox_section(root: str) -> str:
    """The sandbox service's section: the bwrap backend where it can run (root, bubblewrap), else the
    unsafe-process one (the point here is its supervision, not its isolation)."""
    kind = "bwrap" if os.geteuid() == 0 and shutil.which("bwrap") else "unsafe-process"
    return f'[services.sandbox]\ntype = "{kind}"\nroot_dir = "{root}"\n'


def test_chaos_kills_every_role_and_nothing_is_lost(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    sandbox_root = f"/var/tmp/rlbus-chaos-{uuid.uuid4().hex[:8]}"  # reachable by the sandbox user
    os.makedirs(sandbox_root, mode=0o711)
    cfg = run_file(tmp_path, loop_model_dir, run_id="chaos",
                   services={"trainer": 1, "rollout": 1, "judge": 1, "weightsync": 1, "sandbox": 1},
                   extra=sandbox_section(sandbox_root),
                   launcher={"max_restarts": 50, "heartbeat_timeout_s": 40},
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1,
                            "checkpoint_every": 5, "group_timeout_s": 45,
                            "eval": {"prompts": 16},
                            "devices": {"world_size": 2, "device": "cpu"}},
                   rollout={"max_tickets": 16})
    sup = Supervisor(str(cfg), quiet=True)
    metrics = run_dir / "metrics.jsonl"
    rng = random.Random(20261202)
    kills: list[dict] = []
    group_stops: list[float] = []  # seconds from a rank kill to its group's exit
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait_for(lambda: last_step(metrics)[0] >= 3, 300, "the run to reach step 3", interval=1.0)
        # every role dies at least once, the rest at random, at random times
        victims = list(ROLES)
        rng.shuffle(victims)
        chaos_end = time.monotonic() + CHAOS_S
        while time.monotonic() < chaos_end or victims:
            time.sleep(rng.uniform(6.0, 12.0))  # chaos: the next kill comes at a random time
            victim = victims.pop() if victims else rng.choice(ROLES)
            step, _ = last_step(metrics)
            t_kill = since = time.time()
            if victim == "nats":
                sup.nats.kill()
                time.sleep(rng.uniform(0.5, 3.0))  # chaos: NATS stays down a random while
                sup.nats.start()
            elif victim == "trainer-rank":
                pid = wait_for(lambda: live_rank(run_dir, 1), 240, "a live trainer rank 1")
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                # the whole group stops: rank 0 (the service process) exits non-zero, for a restart
                stop = wait_for(lambda t_kill=t_kill: next((e for e in sup.events if e["event"] == "exit"
                                                            and e["child"] == "trainer-0" and e["t"] >= t_kill), None),
                                120, "the trainer's rank group to stop after its rank 1 was killed", interval=0.2)
                assert stop["code"] != 0, stop
                group_stops.append(stop["t"] - t_kill)
                # progress counts from the restarted group (the dying one may have logged a step after the kill)
                step, since = last_step(metrics)[0], stop["t"]
            else:
                ready_before = sandbox_instances_ready(run_dir)
                assert sup.kill_child(f"{victim}-0") is not None, f"{victim} was not running"
                if victim == "sandbox" and "bwrap" in sandbox_section(sandbox_root):
                    # its successor is up, having reaped what the killed instance left (the trainer's steps
                    # do not wait for sandboxes: without this a stop could come before the successor)
                    wait_for(lambda n=ready_before: sandbox_instances_ready(run_dir) > n, 240,
                             "a new sandbox instance after the kill", interval=0.5)
            kills.append({"role": victim, "time": t_kill, "step_before": step})
            # the run must make progress again before the next kill
            recovered = wait_for(lambda step=step, since=since: first_step_after(metrics, step, since),
                                 240, f"progress after killing {victim} at step {step}", interval=0.5)
            kills[-1]["recovery_s"] = recovered - t_kill

        # end the run: stop the trainer's admission by finishing at the next steps
        final_step, _ = last_step(metrics)
        # the supervisor restarted every killed service (none given up on)
        assert not [e for e in sup.events if e["event"] == "crash_loop"], sup.events
    finally:
        sup.stop()
    # the killed sandbox instance's sandboxes were reaped by its successor, the last one cleaned up on stop
    assert mounts_under(sandbox_root) == [] and os.listdir(sandbox_root) == []
    shutil.rmtree(sandbox_root, ignore_errors=True)

    async def check():
        sup2 = Supervisor(str(cfg), quiet=True)
        from services.runtime.natsd import EmbeddedNats

        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            acc = await accounting(nc.jetstream(), "chaos")
            await nc.close()
        del sup2
        return acc

    acc = asyncio.run(check())
    assert acc["lost"] == 0, acc
    assert acc["outcomes_without_trajectory"] == 0, acc
    assert acc["trained"] >= final_step * 4 * 4 * 0.9, acc  # (a restart may retrain a batch whose KV write was lost)
    # the full identity: every trajectory exactly one outcome, pending, or refused by the trainer (dead-lettered:
    # results of tickets a killed trainer had published after its last saved state, so the restarted one cannot
    # tell them from forged ones; never trained, counted)
    assert acc["multiple_outcomes"] == 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] + acc["dead_lettered"], acc
    assert acc["identity_holds"], acc
    assert all(r in ("stale", "group already dropped for staleness", "group already finished", "rollout failed")
               for r in acc["dropped_reasons"]), acc

    # the newest checkpoint is a model that loads
    from transformers import AutoModelForCausalLM

    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)

    per_role: dict[str, list[float]] = {}
    for k in kills:
        per_role.setdefault(k["role"], []).append(k["recovery_s"])
    figures = {
        "kills": len(kills),
        "kills_survived_per_role": {r: len(v) for r, v in per_role.items()},
        "recovery_s_median_per_role": {r: round(statistics.median(v), 1) for r, v in per_role.items()},
        "trainer_rank_group_stop_s": [round(t, 1) for t in group_stops],
        "final_step": final_step,
        "trajectories": {k: acc[k] for k in ("published", "trained", "dropped", "eval", "pending", "lost")},
    }
    print(json.dumps(figures))
    if os.environ.get("RLBUS_FIGURES_DIR"):
        Path(os.environ["RLBUS_FIGURES_DIR"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["RLBUS_FIGURES_DIR"]) / "chaos.json").write_text(json.dumps(figures, indent=2))
