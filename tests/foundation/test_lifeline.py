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
    # the kill comes 1.0 s after the service sees its launcher gone (a look every 0.2 s); this test may wake
    # late after the launcher dies, so it asserts half the bound: without the bound the kill comes at once
    assert time.monotonic() - t0 >= 0.5, "killed before its stop bound (it ignores SIGTERM: only the bound ends it)"


FOLLOWER = textwrap.dedent("""
    import os, signal, sys, time
    from services.runtime import lifeline
    launcher = int(os.environ[lifeline.LAUNCHER_PID_ENV])
    out = sys.argv[1]

    def on_term(sig, frame):  # what a service's SIGTERM handler says, and whether its parent was still the launcher
        still = os.getppid() == launcher
        with open(out, "a") as f:
            f.write(f"term parent_was_launcher={int(still)} gone={int(lifeline.say_if_launcher_gone())}\\n")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    lifeline.watch_launcher()
    with open(out, "a") as f:
        f.write("ready\\n")
    time.sleep(600)
""")

THREADED_LAUNCHER = textwrap.dedent("""
    import ctypes, os, signal, subprocess, sys, threading, time
    from services.runtime.lifeline import LAUNCHER_PID_ENV, STOP_BOUND_ENV
    from services.runtime.natsd import die_with_parent
    mode, out, follower = sys.argv[1], sys.argv[2], sys.argv[3]
    for _ in range(3):  # threads besides the main one, as the launcher has (control server, monitors)
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    env = dict(os.environ, **{LAUNCHER_PID_ENV: str(os.getpid()), STOP_BOUND_ENV: "5"})
    p = subprocess.Popen([sys.executable, "-c", follower, out], env=env, start_new_session=True,
                         preexec_fn=die_with_parent)  # started by the main thread, with the parent-death signal
    deadline = time.monotonic() + 60
    while not (os.path.exists(out) and "ready" in open(out).read()):  # the follower is set up
        if time.monotonic() > deadline:
            sys.exit("the follower did not get ready within 60 s")
        time.sleep(0.01)
    print(p.pid, flush=True)
    if mode == "term":  # a live launcher stops its service
        os.kill(p.pid, signal.SIGTERM)
        time.sleep(600)
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:  # the main thread ends first, the others live on: what a SIGKILL's threads may do in any order
        ctypes.CDLL(None).pthread_exit(None)
""")


@pytest.mark.parametrize("mode", ["term", "main-thread-ends", "kill"])
def test_a_service_stopped_by_the_parent_death_signal_says_its_launcher_is_gone(tmp_path, mode):
    """The parent-death signal comes when the launcher's thread that started the service ends, and the service
    is first handed to another, still living, thread of the launcher: in its SIGTERM handler its parent is
    still the launcher's pid. It must still say the launcher is gone (and must not when the launcher lives
    and stops it)."""
    rounds = 5 if mode == "kill" else 1
    for i in range(rounds):
        out = tmp_path / f"follower-{i}.txt"
        launcher = subprocess.Popen([sys.executable, "-c", THREADED_LAUNCHER, mode, str(out), FOLLOWER],
                                    stdout=subprocess.PIPE, text=True)
        assert launcher.stdout is not None
        follower = int(launcher.stdout.readline())
        try:
            wait_for(lambda out=out: "term" in out.read_text(), 20, "the follower's SIGTERM handler")
            said = out.read_text().splitlines()[-1]
            if mode == "term":
                assert said == "term parent_was_launcher=1 gone=0", said
            elif mode == "main-thread-ends":  # handed to a living thread of the launcher: the pid is the same
                assert said == "term parent_was_launcher=1 gone=1", said
            else:
                assert said.endswith("gone=1"), said
        finally:
            launcher.kill()
            launcher.wait()
            if start_time(follower) is not None:
                os.kill(follower, signal.SIGKILL)
