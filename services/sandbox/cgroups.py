"""Per-sandbox cgroups: memory, pids and CPU limits, the freezer, OOM accounting.

cgroup v1 (separate ``memory``, ``pids``, ``cpu``, ``freezer`` hierarchies) and
v2 (one unified hierarchy with ``cgroup.freeze``) are both supported; which one
is used is detected from ``/proc/self/mountinfo``: v2 when the unified
hierarchy offers the memory, pids and cpu controllers, else v1 when all four v1
controllers are mounted. Sandboxes live in
``<hierarchy root>/<cgroup_parent>/<instance>/<sandbox>``.

The kernel gives no completion notice for "frozen" on v1 nor for "empty" on
either version, so :meth:`Cgroup.freeze` and :meth:`Cgroup.kill_all` re-read the
state with a short exponential backoff under a deadline, as the kernel's
cgroup-v1 freezer documentation prescribes. A v1 freezer can stay ``FREEZING``
when a task was forking or in the middle of a system call as it was asked; the
documentation's remedy is to write ``FROZEN`` again, which :meth:`Cgroup.freeze`
does on every re-check. The deadlines (:data:`STATE_DEADLINE_S`) are generous:
on a loaded two-core machine a freeze has taken seconds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

from services.sandbox.backend import BackendUnavailable, SandboxFailure
from services.sandbox.config import LimitsConfig

log = logging.getLogger("rlbus.sandbox.cgroups")

V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _keyed(path: str, key: str) -> int:
    """The value of ``key`` in a ``key value`` per line file (memory.events, oom_control)."""
    for line in _read(path).splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def _mounts() -> Iterator[tuple[str, str, list[str]]]:
    """(mount point, fs type, super options) from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rfields = right.split()
            if len(fields) < 5 or len(rfields) < 3:
                continue
            mount_point = fields[4].replace("\\040", " ")
            yield mount_point, rfields[0], rfields[2].split(",")


#: how long a freeze or an emptying cgroup may take before it is reported as a failure
STATE_DEADLINE_S = 30.0


async def _until(check, what: str, deadline_s: float = STATE_DEADLINE_S) -> None:  # type: ignore[no-untyped-def]
    """Re-check ``check()`` with exponential backoff until true or the deadline passes."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    delay = 0.0005
    while not check():
        if loop.time() > end:
            raise SandboxFailure(f"cgroup did not {what} within {deadline_s:.0f} s; check the host's kernel log")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


@dataclass
class Cgroup:
    """One sandbox's cgroup (a directory per controller on v1, one directory on v2)."""

    version: int
    #: v1: controller -> directory; v2: {"unified": directory}
    dirs: dict[str, str]

    def _path(self, controller: str, name: str) -> str:
        return os.path.join(self.dirs["unified" if self.version == 2 else controller], name)

    def attach(self, pid: int) -> None:
        """Move ``pid`` (and so everything it forks later) into this cgroup."""
        for d in self.dirs.values():
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def self_attach_files(self) -> list[str]:
        """Files a single-threaded process writes "0" into to move itself here.

        On v1 that is ``tasks`` (moving the current thread skips the global
        threadgroup lock and its RCU grace period); on v2 ``cgroup.procs``.
        """
        name = "cgroup.procs" if self.version == 2 else "tasks"
        return [os.path.join(d, name) for d in self.dirs.values()]

    def pids(self) -> list[int]:
        text = _read(self._path("pids", "cgroup.procs"))
        return [int(p) for p in text.split()]

    def is_frozen(self) -> bool:
        if self.version == 2:
            return _keyed(self._path("", "cgroup.events"), "frozen") == 1
        return _read(self._path("freezer", "freezer.state")).strip() == "FROZEN"

    async def freeze(self) -> None:
        """Stop every process of the sandbox; returns once all are frozen."""
        if self.version == 2:
            _write(self._path("", "cgroup.freeze"), "1")
            await _until(self.is_frozen, "freeze")
            return
        state = self._path("freezer", "freezer.state")
        _write(state, "FROZEN")

        def frozen() -> bool:
            if _read(state).strip() == "FROZEN":
                return True
            _write(state, "FROZEN")  # still FREEZING: ask again (the v1 freezer's documented remedy)
            return False

        await _until(frozen, "freeze")

    def thaw(self) -> None:
        try:
            if self.version == 2:
                _write(self._path("", "cgroup.freeze"), "0")
            else:
                _write(self._path("freezer", "freezer.state"), "THAWED")
        except (FileNotFoundError, KeyError):
            pass  # no freezer directory (a half-made cgroup being reaped): nothing is frozen

    def set_idle(self, idle: bool) -> None:
        """Whether the sandbox's processes only get CPU time that its sibling sandboxes leave (``cpu.idle``; where the
        kernel lacks it, the smallest share): a warm pool's sandbox starting its server must not slow the sandboxes
        in use. Best effort: a kernel without either leaves the weight as it is."""
        try:
            _write(self._path("cpu", "cpu.idle"), "1" if idle else "0")
        except FileNotFoundError:
            name, low, normal = ("cpu.weight", "1", "100") if self.version == 2 else ("cpu.shares", "2", "1024")
            try:
                _write(self._path("cpu", name), low if idle else normal)
            except FileNotFoundError:
                pass

    def oom_kills(self) -> int:
        """Processes the kernel OOM-killed in this cgroup so far."""
        if self.version == 2:
            return _keyed(self._path("", "memory.events"), "oom_kill")
        return _keyed(self._path("memory", "memory.oom_control"), "oom_kill")

    def memory_bytes(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int(_read(self._path("memory", name)))

    def _signal_all(self) -> None:
        if self.version == 2:
            try:
                _write(self._path("", "cgroup.kill"), "1")
                return
            except FileNotFoundError:
                pass  # kernel < 5.14: fall through to per-process kill
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def signal_all(self) -> None:
        """SIGKILL every process now and thaw them so that frozen ones die; no waiting (see :meth:`kill_all`)."""
        try:
            self._signal_all()
        except FileNotFoundError:
            return  # no cgroup (a half-made one): nothing runs in it
        self.thaw()

    async def kill_all(self) -> None:
        """SIGKILL every process (thawing first so frozen ones can die) and wait until none is left."""
        if not self.pids():
            return
        self._signal_all()
        self.thaw()

        def empty() -> bool:
            if self.pids():
                self._signal_all()  # catches processes forked while we were killing
                return False
            return True

        await _until(empty, "empty after SIGKILL")

    def _rmdirs(self) -> bool:
        """Remove the directories; False while the kernel still counts exiting processes in them."""
        for d in self.dirs.values():
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.EBUSY:
                    return False
                raise
        return True

    async def remove(self) -> None:
        """Remove the cgroup once its (killed) processes are gone."""
        if not self._rmdirs():
            await self.kill_all()
            await _until(self._rmdirs, "become removable")


class Hierarchy:
    """Where this host's cgroups are and how to make sandbox cgroups in them."""

    def __init__(self, version: int, roots: dict[str, str], parent: str) -> None:
        self.version = version
        #: v1: controller -> mount point; v2: {"unified": mount point}
        self.roots = roots
        self.parent = parent.strip("/")

    @classmethod
    def detect(cls, parent: str) -> Hierarchy:
        """Find writable cgroups with the controllers sandboxes need, or raise naming what is missing."""
        v1: dict[str, str] = {}
        v2: str | None = None
        for mount_point, fstype, opts in _mounts():
            if fstype == "cgroup2" and v2 is None:
                v2 = mount_point
            elif fstype == "cgroup":
                for c in V1_CONTROLLERS:
                    if c in opts and c not in v1:
                        v1[c] = mount_point
        if v2 is not None:
            try:
                available = _read(os.path.join(v2, "cgroup.controllers")).split()
            except OSError:
                available = []
            if all(c in available for c in V2_CONTROLLERS):
                if not os.access(v2, os.W_OK):
                    raise BackendUnavailable(f"cgroup v2 hierarchy {v2} is not writable: run the service as root")
                return cls(2, {"unified": v2}, parent)
        missing = [c for c in V1_CONTROLLERS if c not in v1]
        if missing:
            where = f"; cgroup v2 at {v2} lacks some of {', '.join(V2_CONTROLLERS)}" if v2 else ""
            raise BackendUnavailable(
                f"cgroup controllers missing: {', '.join(missing)} (v1){where}. Mount them "
                "(e.g. `mount -t cgroup -o freezer none /sys/fs/cgroup/freezer`) or boot with cgroup v2"
            )
        unwritable = [c for c, p in v1.items() if not os.access(p, os.W_OK)]
        if unwritable:
            raise BackendUnavailable(f"cgroup v1 controllers not writable: {', '.join(unwritable)}: run as root")
        return cls(1, v1, parent)

    def _bases(self) -> dict[str, str]:
        return {k: os.path.join(root, self.parent) for k, root in self.roots.items()}

    def _enable_v2_controllers(self, path: str) -> None:
        """Enable memory/pids/cpu for the children of ``path`` and of every ancestor up to the root."""
        root = self.roots["unified"]
        chain = [root]
        rel = os.path.relpath(path, root)
        for part in rel.split(os.sep):
            chain.append(os.path.join(chain[-1], part))
        for d in chain:
            ctl = os.path.join(d, "cgroup.subtree_control")
            enabled = _read(ctl).split()
            want = [c for c in V2_CONTROLLERS if c not in enabled]
            if want:
                try:
                    _write(ctl, " ".join(f"+{c}" for c in want))
                except OSError as e:
                    raise BackendUnavailable(
                        f"cannot enable {want} in {ctl} ({e.strerror}): cgroup v2 forbids controllers in a "
                        "cgroup that holds processes; run the service in a leaf cgroup below it"
                    ) from None

    def prepare_instance(self, instance: str, memory_budget_mb: int | None = None) -> None:
        """Create ``<parent>/<instance>`` in every hierarchy (v2: with controllers enabled); with
        ``memory_budget_mb`` its memory is limited to that (every sandbox of the instance, and the files of
        destroyed ones still charged to it, together)."""
        for base in self._bases().values():
            os.makedirs(os.path.join(base, instance), exist_ok=True)
        if self.version == 2:
            self._enable_v2_controllers(os.path.join(self._bases()["unified"], instance))
        if memory_budget_mb is not None:
            mem = str(memory_budget_mb << 20)
            d = self.instance_dir(instance)
            if self.version == 2:
                _write(os.path.join(d, "memory.max"), mem)
            else:
                _write(os.path.join(d, "memory.limit_in_bytes"), mem)
                memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, mem)

    def instance_dir(self, instance: str) -> str:
        """The instance's memory cgroup directory."""
        return os.path.join(self._bases()["unified" if self.version == 2 else "memory"], instance)

    def working_set_mb(self, instance: str) -> float:
        """The instance's memory use less its reclaimable page cache (inactive file pages), in MiB: what its
        sandboxes hold, files of destroyed sandboxes still charged to it included."""
        d = self.instance_dir(instance)
        if self.version == 2:
            used = int(_read(os.path.join(d, "memory.current")))
            inactive = _keyed(os.path.join(d, "memory.stat"), "inactive_file")
        else:
            used = int(_read(os.path.join(d, "memory.usage_in_bytes")))
            inactive = _keyed(os.path.join(d, "memory.stat"), "total_inactive_file")
        return max(0, used - inactive) / (1 << 20)

    def create(self, instance: str, sandbox: str, limits: LimitsConfig) -> Cgroup:
        """Make the sandbox's cgroup with its limits applied."""
        dirs = {k: os.path.join(base, instance, sandbox) for k, base in self._bases().items()}
        cg = Cgroup(self.version, dirs)
        try:
            for d in dirs.values():
                os.mkdir(d)
            mem = (limits.memory_mb + limits.disk_mb) << 20  # its processes, and its files (bounded by disk_mb)
            quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
            if self.version == 2:
                d = dirs["unified"]
                _write(os.path.join(d, "memory.max"), str(mem))
                try:
                    _write(os.path.join(d, "memory.swap.max"), "0")
                except FileNotFoundError:
                    pass  # no swap accounting: nothing to limit
                _write(os.path.join(d, "pids.max"), str(limits.pids))
                _write(os.path.join(d, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
            else:
                _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"), str(mem))
                memsw = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, str(mem))
                _write(os.path.join(dirs["pids"], "pids.max"), str(limits.pids))
                _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"), str(quota))
        except OSError as e:
            cg._rmdirs()
            raise SandboxFailure(f"cannot create cgroup for sandbox {sandbox}: {e}") from None
        return cg

    def existing(self, instance: str, sandbox: str) -> Cgroup:
        return Cgroup(self.version, {k: os.path.join(b, instance, sandbox) for k, b in self._bases().items()})

    def instances(self) -> set[str]:
        """Instance directories present under ``<parent>`` in any hierarchy."""
        found: set[str] = set()
        for base in self._bases().values():
            try:
                found.update(e.name for e in os.scandir(base) if e.is_dir())
            except FileNotFoundError:
                pass
        return found

    def sandboxes(self, instance: str) -> set[str]:
        found: set[str] = set()
        for base in self._bases().values():
            try:
                found.update(e.name for e in os.scandir(os.path.join(base, instance)) if e.is_dir())
            except FileNotFoundError:
                pass
        return found

    async def remove_instance(self, instance: str) -> list[str]:
        """Kill and remove every sandbox cgroup of ``instance``, then its directory. Returns the sandbox names."""
        names = sorted(self.sandboxes(instance))
        for name in names:
            cg = self.existing(instance, name)
            present = {k: d for k, d in cg.dirs.items() if os.path.isdir(d)}
            cg = Cgroup(self.version, present)
            if "pids" in present or self.version == 2:
                await cg.kill_all()
            await cg.remove()
        for base in self._bases().values():
            try:
                os.rmdir(os.path.join(base, instance))
            except FileNotFoundError:
                pass
        return names
