"""Where a run's CPU goes: ``<run dir>/usage.jsonl``.

While it supervises, the launcher appends a line every ``every_s`` seconds (and one at the stop) with each
live service process's CPU seconds (user + system, from ``/proc/<pid>/stat``) and resident memory, and the
embedded nats-server's. Differences between two lines are each process's share of the machine over that
window (``machine_busy_s`` minus their sum: what other tenants of the machine took): what
``rlbus simulate`` fits its per-message costs to. A service's figure includes its child
processes (the judge's reward workers, a trainer's other ranks, sandboxes), and what a user reads to see which
service is the bottleneck. On a system without ``/proc`` nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("rlbus.launcher")

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _stat(pid: int) -> tuple[int, float, float, int] | None:
    """(parent pid, own CPU seconds, reaped children's CPU seconds, resident bytes), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    own = (int(fields[11]) + int(fields[12])) / _TICK
    reaped = (int(fields[13]) + int(fields[14])) / _TICK
    return int(fields[1]), own, reaped, int(statm[1]) * _PAGE


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (every process, all cores) since boot."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _all() -> dict[int, tuple[int, float, float, int]]:
    out = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit() and (got := _stat(int(entry.name))) is not None:
            out[int(entry.name)] = got
    return out


def tree_usage(pids: dict[str, int]) -> dict[str, tuple[float, int]]:
    """label -> (CPU seconds, resident bytes) of each process with its descendants (live and reaped)."""
    table = _all()
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in table.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for label, root in pids.items():
        if root not in table:
            continue
        cpu, rss, todo = 0.0, 0, [root]
        while todo:
            pid = todo.pop()
            _ppid, own, reaped, resident = table[pid]
            cpu, rss = cpu + own + reaped, rss + resident
            todo.extend(children.get(pid, []))
        out[label] = (cpu, rss)
    return out


class UsageLog:
    """Appends one sample line per ``every_s`` to ``path``; :meth:`record` with ``force`` at the stop."""

    def __init__(self, path: Path, every_s: float = 5.0) -> None:
        self.path, self.every_s = path, every_s
        self.last = float("-inf")
        self.failing = False  # the last append failed (said once, until one works again)

    def record(self, pids: Callable[[], dict[str, int]], force: bool = False) -> None:
        """Sample the processes ``pids()`` names (called only when a line is due)."""
        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        usage = tree_usage(pids())
        cpu = {label: round(c, 3) for label, (c, _) in usage.items()}
        rss = {label: r for label, (_, r) in usage.items()}
        if not cpu or not self.path.parent.is_dir():
            return
        line = {"time": time.time(), "cpu_s": cpu, "rss_bytes": rss, "cores": os.cpu_count(),
                "machine_busy_s": machine_busy_s()}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # a full disk: the record is telemetry, the launcher keeps supervising
            if not self.failing:
                log.warning("usage: cannot append to %s (%s); the run goes on without usage lines until it can",
                            self.path, e)
            self.failing = True
            return
        if self.failing:
            log.warning("usage: appending to %s again", self.path)
        self.failing = False
