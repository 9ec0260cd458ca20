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
import json
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
from services.sandbox.overlay import Layers, WorkTree

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
    #: built by the warm pool and not taken yet: invisible to the verbs, no events, no lease (see ``warm_pool.py``)
    pooled: bool = False

    def adopt(self, run_id: str, spec: Spec) -> None:
        """A create takes this pooled sandbox: it becomes ``run_id``'s, with the create's ``spec`` (the same base,
        limits and egress it was built with; the create's env, labels and lease)."""
        self.run_id, self.spec, self.pooled, self.created_at = run_id, spec, False, time.time()
        self.cgroup.set_idle(False)  # built at idle CPU priority (see ``warm_pool.backend_pool``)
        with open(os.path.join(self.tree.dir, "meta.json"), "w") as f:  # whose it is, for the reaper
            json.dump({"sandbox_id": self.id, "run_id": run_id}, f)

    def kill_now(self) -> None:
        """Destroy's first step, under :attr:`lock` with the state ``destroying``: SIGKILL, without waiting, each
        exec's and the server's pid 1 (their pid namespaces die with them, and nothing can fork into a dying one)
        and every process in the cgroup, thawed so that frozen ones die. The rest (:meth:`wait_gone`) may finish
        after the destroy is answered: nothing of the sandbox runs user code once these signals are sent."""
        for ex in self.execs.values():
            ex.kill()
        if self.server is not None:
            self.server.kill()
        self.cgroup.signal_all()

    async def wait_gone(self, execs: list[Exec | ServerExec]) -> None:
        """Destroy's second step: until every process of the sandbox has exited (stragglers killed again), the
        exec server closed and the cgroup removed."""
        await self.cgroup.kill_all()
        await asyncio.gather(*(ex.proc.wait() for ex in execs))  # their waiters close them
        await self.stop_server()
        await self.cgroup.remove()

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

    async def freeze_layers(self, store: Layers) -> tuple[tuple[str, ...], bool]:
        """Under :attr:`lock`, a snapshot's layers (top first) and whether they were copied: O(1) layer swap when no
        exec runs, else freeze + copy of the writable layer."""
        if not self.execs:
            await self.stop_server()  # its mount namespace holds the upper layer being frozen; the next exec starts one
            return store.swap_upper(self.tree), False
        was_paused = self.state == "paused"
        if not was_paused:
            await self.cgroup.freeze()
        try:
            return await store.copy_upper(self.tree), True
        finally:
            if not was_paused:
                self.cgroup.thaw()

    def info(self, lease_expires_at: float, retained_bytes: int) -> api.SandboxInfo:
        """What ``list`` says of the sandbox."""
        return api.SandboxInfo(
            sandbox_id=self.id, instance_id=self.instance_id, run_id=self.run_id,
            state="paused" if self.state == "paused" else "running", base=self.spec.base, created_at=self.created_at,
            lease_expires_at=lease_expires_at, layers=len(self.tree.layers), running_execs=len(self.execs),
            parent_id=self.parent_id, labels=self.spec.labels, retained_mb=round(retained_bytes / (1 << 20), 3),
        )

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

    def exec_reply(self, run_id: str, ex: Exec | ServerExec, out: execio.Outcome, timeout_s: float) -> api.ExecReply:
        """A foreground exec ended (``out``): its events (``timeout``, ``oom``, ``limit_exceeded``, ``exec_finished``)
        and its reply."""
        oom = self.check_oom(ex.exec_id)
        self.check_disk(ex.exec_id)
        code = execio.exit_code(out.returncode)
        duration = time.monotonic() - ex.started
        if out.timed_out:
            self.emit(api.Timeout(exec_id=ex.exec_id, timeout_s=timeout_s))
        self.emit(api.ExecFinished(exec_id=ex.exec_id, exit_code=code, duration_s=duration, timed_out=out.timed_out,
                                   oom_killed=oom, stdout_bytes=out.stdout_bytes, stderr_bytes=out.stderr_bytes))
        return api.ExecReply(
            run_id=run_id, sandbox_id=self.id, exec_id=ex.exec_id, exit_code=code, stdout=out.stdout,
            stderr=out.stderr, stdout_truncated=out.stdout_truncated, stderr_truncated=out.stderr_truncated,
            duration_s=duration, timed_out=out.timed_out, oom_killed=oom,
        )

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
