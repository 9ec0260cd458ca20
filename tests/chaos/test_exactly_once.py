"""Exactly one outcome per trajectory where it used to break (services/trainer/ledger.py states the rule):

* the trainer SIGKILLed between publishing version v and saving step v's state (a fault point the trainer
  honours once, ``RLBUS_TRAINER_KILL_AFTER_SENDING``): the restart continues from version v with step v's
  outcomes, never from the older checkpoint; version numbers stay equal to step numbers, the accounting's full
  identity holds with no trajectory holding two outcomes, ``summary.json`` agrees with the outcome stream, and
  ``rlbus replay`` rebuilds the step after the crash;
* a 10 MB dataset row: its ticket cannot be published, so the prompt is dead-lettered with the reason, counted
  and passed over; the run finishes and nothing is lost.

* the run's nats-server frozen (SIGSTOP) for 40 s mid-run, the same rule's other case: samples redelivered while
  their step's version is sent are settled with that step, copies of finished groups get no second outcome (the
  unit cases: tests/trainer/test_outcome_ledger.py).

Real processes throughout (NATS, trainer, rollout, judge).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from proto import catalog
from proto.deadletter import DeadLetter
from services.launcher.accounting import accounting, read_all
from services.runtime.natsd import EmbeddedNats
from services.trainer.faults import FAULT_ENV
from tests.conftest import recorded, run_file, trainer_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _run(cfg: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


def _stored(run_dir: Path, run_id: str) -> tuple[dict, list[DeadLetter]]:
    async def read() -> tuple[dict, list[DeadLetter]]:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                acc = await accounting(js, run_id)
                letters = await read_all(js, catalog.DLQ_STREAM.name, catalog.DEAD_LETTERS.wildcard(run_id),
                                         DeadLetter)
                return acc, letters
            finally:
                await nc.close()

    return asyncio.run(read())


def _identity(acc: dict) -> None:
    assert acc["lost"] == 0 and acc["multiple_outcomes"] == 0 and acc["outcomes_without_trajectory"] == 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] + acc["dead_lettered"]
    assert acc["identity_holds"], acc


STEPS, GROUPS, SIZE = 8, 2, 4


def test_a_trainer_killed_between_publishing_and_saving_keeps_one_outcome_each(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="killpub",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": GROUPS, "group_size": SIZE, "total_steps": STEPS, "max_staleness": 1,
                            "checkpoint_every": 2, "max_wall_s": 0},
                   rollout={"max_tickets": 8})
    r = _run(cfg, {FAULT_ENV: "5"})  # killed after sending version 5; the newest checkpoint is step 4's
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run finished at step {STEPS}" in r.stderr
    assert (run_dir / "fault-killed-after-v5").is_file()  # the fault point fired (once)
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "fault point: killed after sending version 5" in log
    assert "resumed at step 5 from kept version 5" in log and "the step being sent was published" in log, log[-3000:]

    # version numbers never shifted: every step produced the version of its number
    records = trainer_records(run_dir / "metrics.jsonl")
    assert records and all(rec["trainer/version"] == rec["step"] for rec in records), records
    acc, letters = _stored(run_dir, "killpub")
    _identity(acc)
    assert acc["trained"] == STEPS * GROUPS * SIZE, acc  # each step's batch trained once, none retrained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["counters"]["trained"] == acc["trained"] and summary["version"] == STEPS, summary
    assert letters == []

    from services.launcher.replay import replay_step

    replayed = replay_step(run_dir, 6)  # the first step after the crash started from the kept version 5
    assert replayed.start_version == 5 and replayed.identical, replayed.report()


def test_a_10mb_dataset_row_costs_only_itself(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(6) for b in range(6)]
    rows.insert(3, {"prompt": "x" * (10 << 20), "answer": "0"})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = run_file(tmp_path, loop_model_dir, run_id="bigrow", services={"trainer": 1, "rollout": 1, "judge": 1},
                   task="dataset", task_options={"path": str(data), "eval_fraction": 0.0, "shuffle": False,
                                                 "max_new_tokens": 4},
                   trainer={"groups_per_step": 2, "group_size": 2, "total_steps": 4, "max_wall_s": 0})
    r = _run(cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run finished at step 4" in r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["counters"]["prompts_dead_lettered"] == 1, summary
    acc, letters = _stored(run_dir, "bigrow")
    _identity(acc)
    (letter,) = letters
    assert letter.original_subject == catalog.PROMPTS.subject("bigrow") and letter.error_type == "TicketTooLarge"
    assert "max_message_bytes" in letter.reason and "shorten or drop the row" in letter.reason
    assert letter.payload.startswith(b"prompt_id=") and len(letter.payload) < 8192
    # the data position moved past it: the prompts after it were trained, the big one was never ticketed
    rec = recorded(run_dir, "bigrow")
    groups = {t.rollout.group_id for t in rec.trajectories}
    assert "g00000003" not in groups and "g00000004" in groups, sorted(groups)
    assert all(len(t.rollout.prompt_text) < 1000 for t in rec.trajectories)


def test_a_frozen_nats_server_gives_no_trajectory_two_outcomes(tmp_path, loop_model_dir):
    """``kill -STOP`` on the run's nats-server for 40 s mid-run (longer than the consumers' ack wait and the
    heartbeat watchdog): deliveries time out and come again, services may be restarted, but every trajectory
    gets exactly one outcome and the full identity holds once the run finishes."""
    import signal
    import threading
    import time

    from services.launcher.supervisor import Supervisor
    from tests.conftest import wait_for

    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="natsfreeze", services={"trainer": 1, "rollout": 1, "judge": 1},
                   launcher={"max_restarts": 20},
                   trainer={"groups_per_step": GROUPS, "group_size": SIZE, "total_steps": 14, "max_staleness": 1,
                            "checkpoint_every": 3, "max_wall_s": 0},
                   rollout={"max_tickets": 8})
    sup = Supervisor(str(cfg), quiet=True)
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait_for(lambda: len(trainer_records(run_dir / "metrics.jsonl")) >= 3, 300, "three steps", interval=0.5)
        assert sup.nats is not None and sup.nats.proc is not None
        pid = sup.nats.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(40)  # the freeze itself (what the test is about), not a synchronisation
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: (run_dir / "summary.json").is_file(), 600, "the run to finish after the freeze", interval=1.0)
    finally:
        sup.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 14, summary
    acc, _ = _stored(run_dir, "natsfreeze")
    _identity(acc)
    assert summary["counters"]["trained"] == acc["trained"], (summary, acc)
