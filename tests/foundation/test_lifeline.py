"""Helper processes end with their owner (services/runtime/lifeline.py): an owner SIGKILLed with a helper
handed to its Reaper takes the helper with it; an owner that stops normally kills it on close; a service
started by a launcher stops, then is killed with its group, once the launcher is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.runtime.lifeline import LAUNCHER_PID_ENV, STOP_BOUND_ENV, descendants, start_time
from tests.conftest import wait_for

OWNER = textwrap.dedent("""
    import os, subprocess, sys, time
    from services.runtime.lifeline import Reaper
    reaper = Reaper(grace_s=1.0)
    helper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
                              start_new_session=True)  # not in the owner's group, ignores SIGTERM: only SIGKILL ends it
    reaper.track([helper.pid])
    forked = os.fork() if sys.argv[1] == "fork" else -1  # a forked child holds the watchdog's pipe open too
    if forked == 0:
        time.sleep(600)
    print(helper.pid, reaper.pid, forked, flush=True)
    if sys.argv[1] == "close":
        reaper.close()
        print("closed", flush=True)
    time.sleep(600)
""")


def owner(mode: str) -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    helper, reaper, forked = (int(x) for x in proc.stdout.readline().split())
    return proc, helper, reaper, forked


@pytest.mark.parametrize("mode", ["wait", "fork"])
def test_a_helper_dies_with_its_sigkilled_owner(mode):
    proc, helper, reaper, forked = owner(mode)
    try:
        started = start_time(helper)
        assert started is not None and helper in descendants(proc.pid)
        proc.kill()
        proc.wait()
        wait_for(lambda: start_time(helper) != started, 15, "the helper to be killed after its owner's SIGKILL")
        wait_for(lambda: start_time(reaper) is None, 15, "the watchdog to exit")
    finally:
        if forked > 0:
            os.kill(forked, signal.SIGKILL)


def test_close_kills_the_helpers_and_the_watchdog():
    proc, helper, reaper, _ = owner("close")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "closed"
        assert start_time(helper) is None and start_time(reaper) is None
    finally:
        proc.kill()
        proc.wait()


LAUNCHED = textwrap.dedent("""
    import signal, subprocess, sys, time
    from services.runtime import lifeline
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a service whose drain never ends
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # in its group
    lifeline.watch_launcher()
    print(grandchild.pid, flush=True)
    time.sleep(600)
""")


def test_a_service_outlives_its_launcher_by_the_stop_bound_at_most():
    # the "launcher": a shell that starts the service in its own group, prints its pid and is SIGKILLed
    env = {**os.environ, STOP_BOUND_ENV: "1.0"}
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, subprocess, sys
            env = dict(os.environ, {LAUNCHER_PID_ENV}=str(os.getpid()))
            p = subprocess.Popen([sys.executable, "-c", {LAUNCHED!r}], env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, text=True)
            print(p.pid, p.stdout.readline().strip(), flush=True)
            os.kill(os.getpid(), 9)
        """)], stdout=subprocess.PIPE, text=True, env=env)
    assert launcher.stdout is not None
    service, grandchild = (int(x) for x in launcher.stdout.readline().split())
    launcher.wait()
    t = {p: start_time(p) for p in (service, grandchild)}
    t0 = time.monotonic()
    wait_for(lambda: all(start_time(p) != t[p] for p in t), 20, "the service and its group to be killed")
    assert time.monotonic() - t0 >= 0.9, "killed before its stop bound (it ignores SIGTERM: only the bound ends it)"
