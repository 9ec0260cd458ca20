"""Killing the launcher ends its run: every service (and what they started) and the embedded nats-server are
gone within the launcher's stop bound, whether the launcher alone or its whole process group is SIGKILLed.
The services are real ones at work (trainer, rollout, judge on the tiny model), read from the launcher's
own "started ... (pid N" lines and from /proc before the kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from services.runtime.lifeline import descendants, start_time
from tests.conftest import run_file, wait_for

pytestmark = pytest.mark.slow

STOP_BOUND_S = 5.0  # launcher.stop_timeout_s of the run: what a service may outlive its launcher by
SLACK_S = 20.0  # detection (0.2 s) plus a loaded test machine's scheduling; not a figure under test


def text(path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize("target", ["launcher", "group"])
def test_services_and_nats_die_with_a_killed_launcher(tmp_path, loop_model_dir, target):
    cfg = run_file(tmp_path, loop_model_dir, run_id=f"ld{target[0]}",
                   services={"trainer": 1, "rollout": 1, "judge": 1},
                   launcher={"stop_timeout_s": STOP_BOUND_S, "restart": False},
                   trainer={"groups_per_step": 2, "total_steps": 100000, "max_staleness": 1},
                   rollout={"max_tickets": 4})
    err = open(tmp_path / "launcher.err", "wb")  # noqa: SIM115 - closed below
    before: dict[int, int | None] = {}
    launcher = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(cfg)], stdout=err,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def started() -> dict[str, int]:
            return {m[0]: int(m[1]) for m in re.findall(r"started (\S+) \(pid (\d+)", text(tmp_path / "launcher.err"))}

        services = wait_for(lambda: len(started()) == 3 and started(), 120, "the launcher to start 3 services")
        # at work: a version the trainer published after a step is applied (the trainer then goes on publishing)
        rollout_log = tmp_path / "run" / "logs" / "rollout-0.log"
        wait_for(lambda: re.search(r"applied weights version [1-9]", text(rollout_log))
                 or launcher.poll() is not None, 300, "the rollout to apply a trained version")
        assert launcher.poll() is None, (tmp_path / "launcher.err").read_text()[-3000:]
        tree = descendants(launcher.pid)
        nats = [p for p in tree if "nats-server" in cmdline(p)]
        assert nats, "no embedded nats-server among the launcher's children"
        assert set(services.values()) <= tree
        before.update({p: start_time(p) for p in tree})
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGKILL)
        else:
            os.killpg(launcher.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.wait(10)

        def survivors() -> list[int]:
            return [p for p, t in before.items() if t is not None and start_time(p) == t]

        try:
            wait_for(lambda: not survivors(), STOP_BOUND_S + SLACK_S, "every process of the run to end")
        except AssertionError:
            left = {p: cmdline(p)[:120] for p in survivors()}
            raise AssertionError(f"alive {time.monotonic() - killed_at:.0f}s after the launcher was killed: {left}") from None
        # the services said why they stopped
        log = text(tmp_path / "run" / "logs" / "trainer-0.log")
        assert "the launcher (pid" in log and "is gone" in log, log[-2000:]
    finally:
        if launcher.poll() is None:
            before.update({p: start_time(p) for p in descendants(launcher.pid)})
            os.killpg(launcher.pid, signal.SIGKILL)
        for p, t in before.items():  # what a failed test leaves is not left to the next one
            if t is not None and start_time(p) == t:
                os.kill(p, signal.SIGKILL)
        err.close()
