"""One sandbox of the bwrap backend: what it was made with, what it holds, and what happens inside it.

:class:`~services.sandbox.bwrap.BwrapBackend` keeps the registry (ids, leases, capacity, the layer store) and
answers the verbs; a :class:`Sandbox` is one entry of that registry: its work tree, cgroup and command line,
its state, its running execs, and its own numbered event stream. What concerns one sandbox alone (emitting
its events, noticing OOM kills, settling an exec that finished) lives here, so the backend reads as the
verbs. A :class:`Snapshot` is the frozen layers of a sandbox and the :class:`Spec` forks inherit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from proto import sandbox as api
from services.sandbox import execio, files
from services.sandbox.backend import EventSink, NotFound
from services.sandbox.bwrap_exec import Exec, Listen
from services.sandbox.cgroups import Cgroup
from services.sandbox.config import LimitsConfig
from services.sandbox.egress import Allowlist, EgressProxy
from services.sandbox.exec_server import ExecServer, ServerExec
from services.sandbox.overlay import WorkTree

log = logging.getLogger("rlbus.sandbox.bwrap")

Spawn = Callable[[], Awaitable[ExecServer]]

#: a volume with less free space than this counts as full (writes of a page or more fail)
FULL_BELOW_BYTES = 16 * 1024


@dataclass(frozen=True)
class Spec:
    """What a sandbox was made with; a snapshot keeps it so forks inherit it."""

    base: str
    limits: LimitsConfig
    env: dict[str, str]
    egress: tuple[str, ...]
    lease_ttl_s: float
    labels: dict[str, str]


@dataclass(frozen=True)
class Snapshot:
    id: str
    sandbox_id: str
    layers: tuple[str, ...]
    spec: Spec


@dataclass
class Sandbox:
    id: str
    run_id: str
    instance_id: str
    on_event: EventSink
    spec: Spec
    tree: WorkTree
    cgroup: Cgroup
    roots: files.Roots
    allowlist: Allowlist
    argv_prefix: list[str]
    created_at: float
    parent_id: str | None = None
    state: str = "running"  # running | paused | destroying
    seq: int = 0
    oom_seen: int = 0
    #: the quotas found exhausted at the last check (``disk``, ``inodes``)
    full: frozenset[str] = frozenset()
    exec_count: int = 0
    execs: dict[str, Exec | ServerExec] = field(default_factory=dict)
    #: whether execs may go through an exec server (the backend's ``exec_server`` and an interpreter in the base)
    server_ok: bool = False
    #: the exec server once it is ready, and its start while in flight (see :meth:`exec_server`)
    server: ExecServer | None = None
    server_start: asyncio.Task[None] | None = None
    snapshots: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def emit(self, detail: api.EventDetail) -> None:
        """Publish the sandbox's next event; a failing sink is logged, never raised."""
        self.seq += 1
        event = api.SandboxEvent(run_id=self.run_id, sandbox_id=self.id, instance_id=self.instance_id, seq=self.seq,
                                 detail=detail)
        try:
            self.on_event(event)
        except Exception:  # a failing sink must not fail the operation that changed the state
            log.exception("event sink failed on %s of %s", event.kind, self.id)

    def ensure_alive(self) -> None:
        """Under :attr:`lock`: refuse to work on a sandbox a concurrent destroy got to first."""
        if self.state == "destroying":
            raise NotFound(f"sandbox {self.id} was destroyed", self.id)

    async def exec_server(self, spawn: Spawn, wait: bool) -> ExecServer | None:
        """Under :attr:`lock`: the ready exec server, or None. ``wait``: it is started now (None: it failed);
        else it is started by ``spawn`` in the background from the sandbox's second exec on (a sandbox that
        runs one exec never pays for a server)."""
        if self.server is not None and not self.server.alive:  # died (OOM-killed, killed from inside): a new one
            dead, self.server = self.server, None
            await dead.close()
            self.server_start = None
        if self.server is None and self.server_ok and self.server_start is None and (wait or self.exec_count >= 2):
            if wait:
                await self._start_server(spawn, locked=True)
            else:
                self.server_start = asyncio.create_task(self._start_server(spawn, locked=False),
                                                        name=f"sandbox-server-{self.id}")
        return self.server

    async def _start_server(self, spawn: Spawn, locked: bool) -> None:
        try:
            async with contextlib.nullcontext() if locked else self.lock:
                # like an exec: spawned under the lock, so a destroy finds it in the cgroup
                if self.state != "running":
                    return
                server = await spawn()
            await server.wait_ready()
        except Exception as e:
            if self.state == "destroying":  # killed by the destroy while it started
                return
            log.warning("sandbox %s: its exec server did not start (%s): its execs run through their own bwrap",
                        self.id, e)
            self.server_ok = False
            return
        if self.state == "destroying":
            await server.close()
        else:
            self.server = server

    async def stop_server(self) -> None:
        """Kill the exec server (and all it runs); the next exec starts another. Called with no exec running:
        in a paused sandbox the server's processes are then all its cgroup holds, and they are thawed to die
        (a frozen process dies only once thawed on cgroup v1), then the cgroup is frozen again."""
        task, self.server_start = self.server_start, None
        server, self.server = self.server, None
        paused = self.state == "paused" and (task is not None or server is not None)
        if paused:
            if server is not None:
                server.kill()
            self.cgroup.thaw()
        try:
            if task is not None and not task.done():
                task.cancel()
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.server is not None:  # the start finished as it was cancelled
                server, self.server = self.server, None
            if server is not None:
                await server.close()
        finally:
            if paused:
                await self.cgroup.freeze()

    def listener(self, egress: EgressProxy, exec_id: str | None) -> Listen | None:
        """The egress listener's opener for this sandbox (None without an allowlist). A refusal names ``exec_id``,
        or (an exec server's listener, shared by its execs) the exec running then if there is only one."""
        if not self.allowlist:
            return None

        def refused(host: str, port: int, reason: str) -> None:
            running = list(self.execs)
            self.emit(api.EgressRefused(host=host, port=port, reason=reason,
                                        exec_id=exec_id or (running[0] if len(running) == 1 else None)))

        return lambda pid: egress.listen(pid, self.allowlist, refused)

    def exec_done(self, ex: Exec | ServerExec) -> None:
        self.execs.pop(ex.exec_id, None)
        ex.close()

    def check_oom(self, exec_id: str | None) -> bool:
        """Whether the cgroup counted new OOM kills (then an ``Oom`` event says so)."""
        try:
            kills = self.cgroup.oom_kills()
        except OSError:
            return False
        if kills <= self.oom_seen:
            return False
        self.oom_seen = kills
        self.emit(api.Oom(exec_id=exec_id, memory_mb=self.spec.limits.memory_mb, kills=kills))
        return True

    def check_disk(self, exec_id: str | None) -> bool:
        """Whether the sandbox's disk or inode quota is exhausted; a ``LimitExceeded`` event for each that is, so
        every exec that ends on a full disk reports it (``exec_id``; None: a ``write_files`` refused for it)."""
        try:
            st = os.statvfs(self.tree.dir)
        except OSError:
            return False
        full = set()
        if st.f_bavail * st.f_frsize < FULL_BELOW_BYTES:
            full.add("disk")
        if st.f_favail == 0:
            full.add("inodes")
        for resource in sorted(full):
            limit = self.spec.limits.disk_mb if resource == "disk" else self.spec.limits.inodes
            self.emit(api.LimitExceeded(resource=resource, limit=limit, exec_id=exec_id))  # type: ignore[arg-type]
        self.full = frozenset(full)
        return bool(full)

    async def wait_detached(self, ex: Exec | ServerExec, timeout: float | None) -> None:
        """Follow a detached exec to its end (killed at ``timeout``) and report it, unless the sandbox went."""
        timed_out = False
        try:
            if timeout is None:
                await ex.proc.wait()
            else:
                try:
                    await asyncio.wait_for(ex.proc.wait(), timeout)
                except TimeoutError:
                    timed_out = True
                    ex.kill()
                    self.emit(api.Timeout(exec_id=ex.exec_id, timeout_s=timeout))
                    await ex.proc.wait()
            await ex.gone()
        finally:
            self.exec_done(ex)
        if self.state == "destroying":
            return
        oom = self.check_oom(ex.exec_id)
        self.check_disk(ex.exec_id)
        self.emit(api.ExecFinished(exec_id=ex.exec_id, exit_code=execio.exit_code(ex.proc.returncode),
                                   duration_s=time.monotonic() - ex.started, timed_out=timed_out, oom_killed=oom))
