"""``rlbus run`` on a run directory that already holds a run: it says what it does (fresh, resuming from
step k, extending), refuses to silently "resume" a finished run, and ``--fresh`` moves the old run aside.
A real finished run for the CLI case; the directory states for the rest."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from services.launcher.runstate import RunDirError, inspect, prepare
from tests.conftest import run_file


def test_states_of_a_run_directory(tmp_path):
    d = tmp_path / "run"
    assert inspect(d) is None and prepare(d, "r", "auto", 10) == f"run r: starting fresh in {d}"
    (d / "nats").mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 3}) + "\n" + json.dumps({"step": 7}) + "\nnot json\n")
    assert "resuming in" in prepare(d, "r", "auto", 10) and "from step 7" in prepare(d, "r", "auto", 10)
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "latest").write_text("step-000005")
    assert "from step 5 (checkpoint" in prepare(d, "r", "auto", 10)
    (d / "summary.json").write_text(json.dumps({"step": 9}))
    with pytest.raises(RunDirError, match=r"already finished at step 9.*--fresh.*--resume"):
        prepare(d, "r", "auto", 10)
    with pytest.raises(RunDirError, match="above 9"):
        prepare(d, "r", "resume", 9)
    assert prepare(d, "r", "resume", 20).startswith("extending run r, finished at step 9")
    said = prepare(d, "r", "fresh", 10)
    assert "moved to" in said and not d.exists() and (tmp_path / "run.1" / "summary.json").is_file()
    d.mkdir()
    (d / "summary.json").write_text("{}")
    prepare(d, "r", "fresh", 10)
    assert (tmp_path / "run.2" / "summary.json").is_file()


@pytest.mark.slow
def test_a_finished_run_is_not_silently_run_again(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="again", services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 2, "total_steps": 2, "max_staleness": 0,
                            "eval": {"prompts": 4}},
                   rollout={"max_tickets": 8})
    cli = [sys.executable, "-m", "services.launcher.cli", "run", str(cfg)]
    first = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "starting fresh in" in first.stderr, first.stderr[-2000:]
    # post-mortem: the run is over, no server runs; tap and status read its stored streams
    tap = subprocess.run([sys.executable, "-m", "services.launcher.cli", "tap", "trajectories", "-c", str(cfg),
                          "--from-start", "--until-end"], capture_output=True, text=True, timeout=120)
    assert tap.returncode == 0, tap.stderr[-2000:]
    assert "reading the streams stored in" in tap.stderr
    records = [json.loads(line) for line in tap.stdout.splitlines()]
    trained = [r for r in records if not r["data"]["rollout"]["is_eval"]]
    assert len(trained) >= 2 * 2 * 4 and all(r["subject"] == "rlbus.again.trajectories" for r in records)
    status = subprocess.run([sys.executable, "-m", "services.launcher.cli", "status", "--run-dir",
                             str(tmp_path / "run"), "-c", str(cfg), "--json"], capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0, status.stderr[-2000:]
    assert json.loads(status.stdout)["trainer"]["state"] == "finished"
    again = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already finished at step 2" in again.stderr, again.stderr[-2000:]
    assert "run finished" not in again.stderr  # nothing was started
    more = subprocess.run(cli + ["--resume", "--set", "services.trainer.total_steps=4"], capture_output=True,
                          text=True, timeout=600)
    assert more.returncode == 0 and "extending run again, finished at step 2" in more.stderr, more.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 4
    fresh = subprocess.run(cli + ["--fresh"], capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0 and "moved to" in fresh.stderr, fresh.stderr[-2000:]
    assert json.loads((tmp_path / "run.1" / "summary.json").read_text())["step"] == 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 2


def test_no_nats_error_on_a_clean_stop(tmp_path, loop_model_dir):
    """The launcher's own connections close before its NATS server stops: nothing says "unexpected EOF"."""
    cfg = run_file(tmp_path, loop_model_dir, run_id="quiet", services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 2, "total_steps": 1, "max_staleness": 0,
                            "eval": {"prompts": 2}},
                   rollout={"max_tickets": 8})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "NATS error" not in r.stderr and "unexpected EOF" not in r.stderr, r.stderr[-2000:]


def test_a_configuration_error_is_not_restarted(tmp_path, loop_model_dir):
    """A service that stops on a configuration error (here: a model directory that does not exist) exits with
    EX_CONFIG; the launcher does not restart it (it would fail the same way) and says why, with its log."""
    cfg = run_file(tmp_path, tmp_path / "no-such-model", run_id="badcfg",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 2, "total_steps": 2}, rollout={"max_tickets": 8})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    # the trainer and the rollout both load the model: whichever fails first stops the run (on a loaded machine
    # the rollout can be first)
    said = re.findall(r"(trainer-0|rollout-0) stopped on a configuration error, not restarting it", r.stderr)
    assert said, r.stderr[-3000:]
    assert "no-such-model" in r.stderr  # the reason, from its log
    assert "run failed: " in r.stderr
    assert not re.search(r"(trainer-0|rollout-0) exited with code", r.stderr), r.stderr[-3000:]  # never restarted
