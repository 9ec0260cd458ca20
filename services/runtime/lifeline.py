"""Processes that end with the process that owns them, however it ends.

* **A service ends with its launcher.** The launcher starts each service with the parent-death signal
  set to SIGTERM (:func:`services.runtime.natsd.die_with_parent`) and tells it its own pid and stop
  bound (:data:`LAUNCHER_PID_ENV`, :data:`STOP_BOUND_ENV`). :func:`watch_launcher` (called by
  ``rlbus service``) then checks every :data:`WATCH_PERIOD_S` that the launcher is still its parent; once
  it is not (the launcher died, even by SIGKILL, and the service was re-parented), the service stops as on
  SIGTERM, and if it has not exited within the stop bound it is killed with every process of its group
  (its engines, reward workers): a service outlives its launcher by at most the launcher's
  ``stop_timeout_s``. A service run by hand (``rlbus service`` from a shell) has no launcher to follow.
* **Helper processes end with their owner** (:class:`Reaper`): a small watchdog process holds a pipe
  from the owner; when the pipe closes (the owner exited or was SIGKILLed) it kills the processes the
  owner handed it (an inference engine's core and workers), SIGTERM first, SIGKILL after ``grace_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

log = logging.getLogger("rlbus.lifeline")

#: set by the launcher in each service's environment: the launcher's pid
LAUNCHER_PID_ENV = "RLBUS_LAUNCHER_PID"
#: set by the launcher: seconds a service whose launcher died may take to stop before it is killed
STOP_BOUND_ENV = "RLBUS_STOP_BOUND_S"
#: how often a service checks that its launcher is alive
WATCH_PERIOD_S = 0.2

_followed: dict[str, float] = {}  # the launcher this process follows: {"pid": ..., "bound": ...}
_told = threading.Lock()  # taken once by whoever says first that the launcher is gone


def launcher_env(stop_bound_s: float) -> dict[str, str]:
    """The environment entries the launcher gives a service it starts."""
    return {LAUNCHER_PID_ENV: str(os.getpid()), STOP_BOUND_ENV: str(stop_bound_s)}


def watch_launcher() -> threading.Thread | None:
    """Stop this process when the launcher that started it dies (see the module docstring); a no-op for a
    service run by hand. The entries are removed from the environment so helpers do not inherit them."""
    raw = os.environ.pop(LAUNCHER_PID_ENV, "")
    bound = float(os.environ.pop(STOP_BOUND_ENV, "") or 20.0)
    if not raw.isdigit():
        return None
    launcher = int(raw)
    _followed.update(pid=launcher, bound=bound)
    thread = threading.Thread(target=_watch, args=(launcher, bound), name="rlbus-lifeline", daemon=True)
    thread.start()
    return thread


def say_if_launcher_gone() -> bool:
    """Log (once) that the launcher this process follows is gone, if it is: a service's SIGTERM handler
    calls it, because the parent-death signal usually arrives, and the service may stop, before the
    watch thread's next look. True when the launcher is gone."""
    launcher = int(_followed.get("pid", 0))
    if not launcher or (os.getppid() == launcher and not launcher_dying(launcher)):
        return False
    if _told.acquire(blocking=False):
        log.error("the launcher (pid %d) is gone; stopping, and exiting within %.0fs", launcher, _followed["bound"])
    return True


_PF_EXITING = 0x4  # the kernel's task flag of a thread that has begun to exit (/proc/PID/stat, field 9)
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def launcher_dying(pid: int) -> bool:
    """Whether process ``pid`` is gone or on its way out. The parent-death signal is sent when the *thread*
    that started a service exits, and the service is then handed to another live thread of the same
    process; so for a moment after its launcher was SIGKILLed a service still has the launcher's pid as
    its parent. A SIGKILL of a process marks it pending in every thread at once, and a thread that took it
    has begun to exit; the main thread of a process ends only with the process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    except (OSError, IndexError, ValueError):
        return True  # gone
    if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return True
    return any(int(status.get(key, b"0").strip(), 16) & _SIGKILL_BIT for key in (b"SigPnd", b"ShdPnd"))


def _watch(launcher: int, bound: float) -> None:
    while os.getppid() == launcher:
        time.sleep(WATCH_PERIOD_S)
    say_if_launcher_gone()
    os.kill(os.getpid(), signal.SIGTERM)  # the graceful stop (the parent-death signal may have said it already)
    time.sleep(bound)
    log.error("still running %.0fs after the launcher died; killing this service and its process group", bound)
    if os.getpgrp() == os.getpid():  # the launcher starts each service as the leader of its own group
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


# --- helper processes -------------------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot; tells a pid from its later reuse), or None
    when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def descendants(pid: int | None = None) -> set[int]:
    """Live descendants of ``pid`` (default: this process), from /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {p for p in found if start_time(p) is not None}


def kill_all(procs: dict[int, int], grace_s: float) -> list[int]:
    """SIGTERM every still-running ``pid -> start time``, SIGKILL what is left after ``grace_s``; returns the
    pids that had to be killed."""
    live = [p for p, t in procs.items() if start_time(p) == t]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(start_time(p) == procs[p] for p in live):
            time.sleep(0.05)
    return live


class Reaper:
    """A watchdog process (``python -m services.runtime.lifeline``) that kills the processes handed to
    :meth:`track` when this process ends, SIGKILL of this process included."""

    def __init__(self, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s
        self.tracked: dict[int, int] = {}
        # not a new session: a kill of this process's group takes the watchdog too, with what it tracks
        owner = os.getpid()
        self._proc = subprocess.Popen([sys.executable, "-m", "services.runtime.lifeline", str(grace_s), str(owner),
                                       str(start_time(owner))], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def track(self, pids: Iterable[int]) -> None:
        """Kill ``pids`` when this process ends (unless :meth:`kill` did it first)."""
        assert self._proc.stdin is not None
        for p in pids:
            t = start_time(p)
            if t is not None and p != self._proc.pid:
                self.tracked[p] = t
                self._proc.stdin.write(f"{p} {t}\n".encode())
        self._proc.stdin.flush()

    def alive(self) -> list[int]:
        """The tracked processes still running."""
        return [p for p, t in self.tracked.items() if start_time(p) == t]

    def kill(self, grace_s: float | None = None) -> list[int]:
        """Kill the tracked processes now (SIGTERM, SIGKILL after ``grace_s``); the pids that were running."""
        return kill_all(self.tracked, self.grace_s if grace_s is None else grace_s)

    def close(self) -> None:
        """Kill what is still tracked and let the watchdog go."""
        self.kill()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _reaper_main(grace_s: float, owner: int, owner_started: int) -> None:
    """Until the owner closes the pipe or is gone: a forked child of the owner (vLLM forks its engine core)
    holds the pipe open too, so the owner's life is also checked every :data:`WATCH_PERIOD_S`."""
    import select

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the owner, which stops in order
    procs: dict[int, int] = {}
    fd, pending = sys.stdin.fileno(), b""
    while True:
        owner_alive = start_time(owner) == owner_started
        # what the owner wrote is read before acting on its death (it may have died before this started)
        if not select.select([fd], [], [], WATCH_PERIOD_S if owner_alive else 0)[0]:
            if owner_alive:
                continue
            break
        data = os.read(fd, 65536)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            pid, _, started = line.decode().partition(" ")
            procs[int(pid)] = int(started)
    killed = kill_all(procs, grace_s)
    if killed:
        print(f"rlbus lifeline: the owner ended; killed {sorted(killed)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _reaper_main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
