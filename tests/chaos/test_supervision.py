"""The launcher's local supervision, with real service processes: a service that stops heartbeating is
killed and restarted once it has been silent for ``heartbeat_timeout_s``; a service that keeps crashing is
given up on and reported with its crash count and the last lines of its log."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from services.launcher.supervisor import Supervisor
from services.runtime.config import ConfigError
from services.runtime.natsd import free_port
from services.runtime.service import CONFIG_ERROR_EXIT
from tests.conftest import wait_for

pytestmark = pytest.mark.slow


def write_run(tmp_path, launcher: str, extra: str = "") -> str:
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\nid = "sup"\ndir = "{tmp_path / "run"}"\n[launcher]\n{launcher}\n'
                    f'nats_port = {free_port()}\n[common]\nheartbeat_s = 0.5\n' + extra)
    return str(path)


def first_event(cfg: str, event: str, timeout: float) -> tuple[Supervisor, dict]:
    """Supervise the run until its first ``event`` (e.g. ``crash_loop``) is recorded; the stopped
    supervisor and that event."""
    sup = Supervisor(cfg, quiet=True)
    try:
        sup.start()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        (report,) = wait_for(lambda: [e for e in sup.events if e["event"] == event], timeout,
                             f"a {event} event to be recorded")
    finally:
        sup.stop()
    return sup, report


def child(sup: Supervisor, label: str):
    return next(c for c in sup.children if c.label == label)


def test_a_silent_service_is_killed_and_restarted(tmp_path):
    # two echo services: the watchdog acts only while someone is still heard (else it is the bus, not them)
    timeout = 8.0
    cfg = write_run(tmp_path, f"services = {{ echo = 2 }}\nheartbeat_timeout_s = {timeout}")
    sup = Supervisor(cfg, quiet=True)
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait_for(lambda: {"echo/echo-0", "echo/echo-1"} <= set(sup.last_seen), 120, "both echo services heard")
        silent = child(sup, "echo-0")
        pid = silent.proc.pid
        os.kill(pid, signal.SIGSTOP)  # alive but silent: what a hung event loop looks like from outside
        stopped_at = time.monotonic()
        hung = wait_for(lambda: [e for e in sup.events if e["event"] == "hung" and e["child"] == "echo-0"],
                        timeout + 120, "the watchdog to kill the silent echo-0")
        detected_after = time.monotonic() - stopped_at
        assert detected_after >= timeout - 1.0, "killed before it had been silent for heartbeat_timeout_s"
        assert len(hung) == 1
        # restarted: a new process that heartbeats again; the other service was never touched
        wait_for(lambda: silent.proc is not None and silent.proc.pid != pid and silent.proc.poll() is None, 120,
                 "echo-0 restarted")
        heard_before = sup.last_seen["echo/echo-0"]
        wait_for(lambda: sup.last_seen["echo/echo-0"] > heard_before, 120, "the restarted echo-0's heartbeat")
        assert not [e for e in sup.events if e["child"] == "echo-1"]
    finally:
        sup.stop()


def test_a_crash_loop_is_reported_with_its_count_and_last_log_lines(tmp_path):
    # a model directory whose config.json is corrupt: every start fails the same way, at run time (a
    # configuration error would not be restarted at all: the run file must change)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cfg = write_run(tmp_path, "services = { rollout = 1 }\nmax_restarts = 2\nrestart_window_s = 600",
                    extra=f'[model]\nname = "{broken}"\n')
    sup, report = first_event(cfg, "crash_loop", 180)
    assert report["child"] == "rollout-0" and report["crashes"] == 3 and report["code"] != 0
    exits = [e for e in sup.events if e["event"] == "exit" and e["child"] == "rollout-0"]
    assert len(exits) == 3  # started, restarted twice, then left down
    assert report["last_lines"] and any("is not a valid JSON file" in line for line in report["last_lines"]), report
    assert child(sup, "rollout-0").given_up


def test_an_unknown_key_stops_the_launcher_before_anything_starts(tmp_path):
    # the whole run file is typed: a key no service knows is refused at once, naming it, nothing started
    cfg = write_run(tmp_path, "services = { echo = 1 }", extra="[services.echo]\nno_such_key = 1\n")
    with pytest.raises(ConfigError, match="services.echo.no_such_key: unknown key"):
        Supervisor(cfg, quiet=True)
    assert not (tmp_path / "run" / "logs").exists()


def test_a_configuration_error_is_reported_and_not_restarted(tmp_path, monkeypatch):
    # a setting only the service can check (the environment variable its HMAC key is read from is unset):
    # restarting cannot help, the run file (or the environment) must change
    monkeypatch.delenv("RLBUS_TEST_UNSET_HMAC_KEY", raising=False)
    cfg = write_run(tmp_path, "services = { weightsync = 1 }\nmax_restarts = 2\nrestart_window_s = 600",
                    extra='[weights]\nhmac_key_env = "RLBUS_TEST_UNSET_HMAC_KEY"\n')
    sup, report = first_event(cfg, "config_error", 120)
    assert report["child"] == "weightsync-0" and report["code"] == CONFIG_ERROR_EXIT
    assert any("RLBUS_TEST_UNSET_HMAC_KEY" in line for line in report["last_lines"]), report
    assert [e["code"] for e in sup.events if e["event"] == "exit" and e["child"] == "weightsync-0"] == \
        [CONFIG_ERROR_EXIT]
    assert child(sup, "weightsync-0").given_up
