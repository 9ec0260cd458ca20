"""The bubblewrap backend: namespaces + cgroups + overlayfs, one bwrap process tree per exec.

A sandbox is a filesystem (an overlay work directory and a private /tmp), limits (a cgroup) and a network policy;
it holds processes only while execs run. Each exec starts ``setpriv`` (drop to the unprivileged ``sandbox_uid``) →
``bwrap`` with new user, pid, ipc, uts, mount, net and cgroup namespaces, the read-only base root,
``--die-with-parent`` and a scrubbed environment. The exec's process tree lives in its own pid namespace: when the
command exits, whatever it left running dies with it. A *detached* exec replies at once and keeps running until it
exits or the sandbox is destroyed; that is how long-running processes (a server, a counter loop) live in a sandbox.
Processes of different execs share the filesystem, limits and freezer but not pid or network namespaces.

With ``exec_path`` ``server`` or ``hybrid`` (the default; the server from the second exec on), a sandbox's execs run
instead as children of one persistent exec server, the sandbox's pid 1, started through that same command line once
(:mod:`.exec_server`): the same uid, namespaces, cgroup, environment, timeouts and output caps, without a new bwrap
per exec; execs then share the sandbox's pid and network namespace, and each exec's process tree is killed when its
command ends. With ``warm_pool``, sandboxes of the default spec wait built, their server running, for the creates
that ask for exactly that spec (:mod:`.warm_pool`). A destroy answers once everything in the sandbox is SIGKILLed;
the wait for the processes to exit, the cgroup's removal and the volume's unmount finish in the background.

How one exec is started (and joins the cgroup without a race) is in :mod:`.bwrap_exec`; one sandbox's record,
events and exec bookkeeping are in :mod:`.bwrap_sandbox`. This module is the backend: the instance (start, reaping,
shutdown), the registry of sandboxes and snapshots, and the verbs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable

from proto import sandbox as api
from services.sandbox import backend, common, execio, files
from services.sandbox.backend import (
    BackendUnavailable,
    Conflict,
    EventSink,
    InvalidRequest,
    NotFound,
    SandboxFailure,
)
from services.sandbox.bwrap_exec import command_prefix, smoke_test, spawn
from services.sandbox.bwrap_sandbox import Sandbox, Snapshot, Spawn, Spec
from services.sandbox.cgroups import Hierarchy
from services.sandbox.config import SandboxConfig
from services.sandbox.egress import Allowlist, EgressPolicy, EgressProxy
from services.sandbox.etc import write_etc
from services.sandbox.exec_server import ExecServer, server_python_in
from services.sandbox.host import base_args, check_prerequisites, python_env, reap_instance, reap_orphans
from services.sandbox.images import resolve_image
from services.sandbox.overlay import Layers, remove_all
from services.sandbox.warm_pool import PoolKey, backend_pool, pool_key

log = logging.getLogger("rlbus.sandbox.bwrap")


class BwrapBackend:
    """Sandboxes isolated by bubblewrap, cgroups and overlayfs (see the module docstring)."""

    def __init__(self, config: SandboxConfig, on_event: EventSink) -> None:
        self.cfg = config
        self.on_event = on_event
        self.instance_id = config.instance_id or common.new_instance_id()
        self.state_dir = os.path.join(config.root_dir, self.instance_id)
        self.sandboxes: dict[str, Sandbox] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.leases = common.LeaseTable(self._lease_expired)
        self.egress = EgressProxy(config.egress_port, config.egress_connect_timeout_s,
                                  EgressPolicy(list(config.egress_open_internal)))
        self._lock = common.InstanceLock(self.state_dir)
        self._tasks: set[asyncio.Task[None]] = set()
        self._base_args: dict[str, list[str]] = {}
        #: the bases whose sandboxes run an exec server (``exec_path`` not ``bwrap``, and its interpreter in the base)
        self._server_bases: set[str] = set()
        self.hierarchy: Hierarchy | None = None
        self.layers: Layers | None = None
        #: why the warm pool must not refill now, beyond this backend's own bounds (the service's admission)
        self.pressure: Callable[[], str | None] = lambda: None
        self.pool = backend_pool(self)

    # --- lifecycle of the backend ------------------------------------------------------------

    def protect_bus(self, endpoints: list[tuple[str, int]]) -> None:
        """The bus's servers (host, port): no sandbox may reach them, whatever its allowlist says."""
        self.egress.policy.protect_bus(endpoints)

    async def start(self) -> list[str]:
        """Check the host, reap orphans (a dead predecessor with this id included), take the state dir."""
        self.hierarchy = check_prerequisites(self.cfg)
        reaped: list[str] = []
        if os.path.isdir(self.state_dir):  # a predecessor with our id: reap it like any orphan
            if not self._lock.try_acquire():
                raise BackendUnavailable(f"instance id {self.instance_id} is in use by a live process "
                                         f"(lock {self._lock.path}); choose another instance_id")
            reaped += await reap_instance(self.cfg, self.hierarchy, self.instance_id, self.on_event, keep_dir=False)
            self._lock.release()
        reaped += await self.reap_orphans()
        # make the state dir under a temporary name with its lock held, then move it into place, so a
        # reaper scanning root_dir never sees it unlocked
        tmp = os.path.join(self.cfg.root_dir, f".new-{self.instance_id}-{os.getpid()}")
        os.makedirs(tmp, mode=0o711)
        self._lock = common.InstanceLock(tmp)
        if not self._lock.try_acquire():
            raise BackendUnavailable(f"cannot lock {tmp}")
        os.rename(tmp, self.state_dir)
        self._lock.path = os.path.join(self.state_dir, "lock")
        os.mkdir(os.path.join(self.state_dir, "s"), 0o711)
        self.layers = Layers(self.state_dir, self.cfg.sandbox_uid, self.cfg.sandbox_gid, self.cfg.max_layers)
        self.hierarchy.prepare_instance(self.instance_id, self.cfg.memory_budget())
        etc_dir = os.path.join(self.state_dir, "etc")
        write_etc(self.cfg, etc_dir)
        cache = os.path.join(self.cfg.root_dir, ".images")
        roots = {name: await asyncio.to_thread(resolve_image, name, path, cache)
                 for name, path in self.cfg.images.items()}
        self._base_args = {"host": base_args(self.cfg, "host", etc_dir),
                           **{name: base_args(self.cfg, name, etc_dir, root) for name, root in roots.items()}}
        self._server_bases = {base for base, root in [("host", "/"), *roots.items()]
                              if self.cfg.exec_path != "bwrap" and server_python_in(self.cfg, base, root)}
        empty = self.layers.empty
        await smoke_test(command_prefix(self.cfg, self._base_args["host"], empty, empty, empty, []))
        if self.cfg.warm_pool:
            self.pool.set_target(PoolKey("host", self.cfg.default_limits, ()), self.cfg.warm_pool)
        self.pool.start()
        log.info("sandbox instance %s ready (bwrap, cgroup v%d, state %s)", self.instance_id,
                 self.hierarchy.version, self.state_dir)
        return reaped

    async def close(self, timeout_s: float | None = None) -> None:
        """Destroy every sandbox (reason ``shutdown``) and remove this instance's state, within ``timeout_s``.

        Past it, what is left (sandboxes not yet destroyed, their mounts and cgroups) stays for the reaper: the
        lock goes with this process, and the next instance to start on ``root_dir`` reaps it as an orphan."""
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        await self.pool.close()
        left = list(self.sandboxes.values())
        while left and (end is None or loop.time() < end):
            sb = left.pop()
            await self._destroy(sb, "shutdown", emit=not sb.pooled)
        pending = set(self._tasks)  # trash deletions, finished execs
        if pending:
            await asyncio.wait(pending, timeout=None if end is None else max(0.0, end - loop.time()))
        if left or any(not t.done() for t in pending):
            log.warning("instance %s stopping: %d sandboxes not destroyed within %.1fs, left to the reaper of the "
                        "next instance on %s", self.instance_id, len(left), timeout_s, self.cfg.root_dir)
        elif self.hierarchy is not None and self.layers is not None:
            await reap_instance(self.cfg, self.hierarchy, self.instance_id, self.on_event, keep_dir=False)
        self._lock.release()
        self.egress.close()

    def held(self) -> tuple[int, int]:
        """(sandboxes this instance holds: in use, pooled and being destroyed; of which pooled, free to take)."""
        return len(self.sandboxes), len(self.pool)

    def wake_pool(self) -> None:
        self.pool.wake()

    def server_spawn(self, sb: Sandbox) -> Spawn:
        """How ``sb``'s exec server starts (through its command line; with its egress listener if it has one)."""
        return lambda: ExecServer.spawn(sb.argv_prefix, self.cfg.exec_server_python, dict(self.cfg.env),
                                        sb.listener(self.egress, None))

    def gauges(self) -> dict[str, float]:
        return self.pool.gauges()

    def memory_used_mb(self) -> float:
        """The instance's working set in MiB (its cgroup: every sandbox, and files of destroyed ones still used)."""
        return self._ready()[1].working_set_mb(self.instance_id)

    async def reap_orphans(self) -> list[str]:
        """Destroy sandboxes of dead instances under ``root_dir``; returns their ids."""
        if self.hierarchy is None:
            raise BackendUnavailable("call start() first")
        return await reap_orphans(self.cfg, self.hierarchy, self.instance_id, self.on_event)

    # --- helpers -----------------------------------------------------------------------------

    def _ready(self) -> tuple[Layers, Hierarchy]:
        if self.layers is None or self.hierarchy is None:
            raise BackendUnavailable("the sandbox backend is not started: call start() first")
        return self.layers, self.hierarchy

    def _get(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == "destroying" or sb.pooled:
            raise NotFound(f"no sandbox {sandbox_id} on instance {self.instance_id}", sandbox_id)
        return sb

    def _spawn_task(self, coro, name: str) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _new_sandbox(self, run_id: str, spec: Spec, layers: tuple[str, ...], parent_id: str | None,
                           pooled: bool = False) -> Sandbox:
        layers_store, hierarchy = self._ready()
        if not pooled and len(self.sandboxes) >= self.cfg.sandboxes_bound() and (spare := self.pool.evict()):
            await self._destroy(spare, "shutdown", emit=False, wait=True)  # a pooled sandbox makes room for this one
        common.check_capacity(len(self.sandboxes), self.cfg)
        common.check_memory(self.memory_used_mb(), spec.limits, self.cfg)
        sid = common.new_id(self.instance_id, lambda s: s in self.sandboxes)
        tree = layers_store.new_tree(os.path.join(self.state_dir, "s", sid), layers, spec.limits.disk_mb,
                                     spec.limits.inodes)
        try:
            cgroup = hierarchy.create(self.instance_id, sid, spec.limits)
        except BaseException:
            remove_all(layers_store.drop_tree(tree))
            raise
        with open(os.path.join(tree.dir, "meta.json"), "w") as f:
            json.dump({"sandbox_id": sid, "run_id": run_id, **({"pooled": True} if pooled else {})}, f)
        sb = Sandbox(
            id=sid, run_id=run_id, instance_id=self.instance_id, on_event=self.on_event, spec=spec,
            tree=tree, cgroup=cgroup,
            roots=files.Roots(workdir=self.cfg.workdir, work_host=tree.merged, tmp_host=tree.tmp),
            allowlist=Allowlist(list(spec.egress)),
            argv_prefix=command_prefix(self.cfg, self._base_args[spec.base], tree.merged, tree.tmp, tree.shm,
                                       cgroup.self_attach_files()),
            created_at=time.time(), parent_id=parent_id, server_ok=spec.base in self._server_bases, pooled=pooled,
        )
        self.sandboxes[sid] = sb
        return sb

    # --- verbs -------------------------------------------------------------------------------

    async def create(self, req: api.CreateRequest) -> api.CreateReply:
        key = pool_key(req, self.cfg, self._base_args, self.egress.policy)
        spec = Spec(
            base=key.base, limits=key.limits, env=common.check_env(dict(req.env)), egress=key.egress,
            lease_ttl_s=common.resolve_ttl(req.lease_ttl_s, self.cfg.default_lease_ttl_s, self.cfg),
            labels=dict(req.labels),
        )
        if self.pool.ready(key):  # taking one adds no sandbox, but the create would be refused past the budget
            common.check_memory(self.memory_used_mb(), key.limits, self.cfg)
        sb = self.pool.take(key)
        if sb is not None:
            sb.adopt(req.run_id, spec)
        else:
            sb = await self._new_sandbox(req.run_id, spec, (), None)
        try:
            if req.files:
                files.write_files(sb.roots, req.files, self.cfg.sandbox_uid, self.cfg.sandbox_gid)
        except BaseException:
            await self._destroy(sb, "failed", emit=False)
            raise
        expires = self.leases.set(sb.id, spec.lease_ttl_s)
        sb.emit(api.Created(
            base=spec.base, limits=common.api_limits(spec.limits),
            egress=list(spec.egress), lease_ttl_s=spec.lease_ttl_s, labels=spec.labels,
        ))
        return api.CreateReply(run_id=req.run_id, sandbox_id=sb.id, instance_id=self.instance_id,
                               lease_expires_at=expires)

    async def exec(self, req: api.ExecRequest) -> api.ExecReply:
        sb = self._get(req.sandbox_id)
        timeout = common.resolve_timeout(req, self.cfg)
        cap = common.resolve_output_cap(req, self.cfg)
        argv = common.command_argv(req.command)
        cwd = req.cwd or self.cfg.workdir
        if not cwd.startswith("/"):
            raise InvalidRequest(f"cwd {cwd!r} must be an absolute path inside the sandbox")
        env = {**self.cfg.env, **python_env(self.cfg), "HOME": self.cfg.workdir, **sb.spec.env, **common.check_env(dict(req.env))}
        if sb.allowlist:
            env.update(self.egress.env())
        async with sb.lock:
            if sb.state == "paused":
                raise Conflict(f"sandbox {sb.id} is paused: resume it before exec", sb.id)
            if sb.state != "running":
                raise NotFound(f"sandbox {sb.id} is being destroyed", sb.id)
            sb.exec_count += 1
            exec_id = f"{sb.id}-e{sb.exec_count}"
            server = await sb.exec_server(self.server_spawn(sb), wait=self.cfg.exec_path == "server")
            ex = None
            if server is not None:
                with contextlib.suppress(SandboxFailure):  # it died just now: this exec goes the other way
                    ex = await server.run(exec_id, argv, env, cwd, req.detach)
            if ex is None:  # no server (yet, or here): this exec gets its own bwrap
                ex = await spawn(sb.argv_prefix, argv, env, cwd, req.detach, sb.listener(self.egress, exec_id))
                ex.exec_id = exec_id
            sb.execs[exec_id] = ex
        sb.emit(api.ExecStarted(exec_id=exec_id, argv=[a[:200] for a in argv], detach=req.detach))
        if req.detach:
            self._spawn_task(sb.wait_detached(ex, timeout), f"sandbox-detached-{exec_id}")
            return api.ExecReply(run_id=req.run_id, sandbox_id=sb.id, exec_id=exec_id, exit_code=None, detached=True)
        try:
            out = await execio.communicate(ex.proc, req.stdin, cap, timeout or self.cfg.max_timeout_s, ex.kill)
            if not out.timed_out or sb.state != "paused":
                await ex.gone()
        except BaseException:
            ex.kill()
            raise
        finally:
            sb.exec_done(ex)
        return sb.exec_reply(req.run_id, ex, out, timeout or self.cfg.max_timeout_s)

    async def write_files(self, req: api.WriteFilesRequest) -> api.WriteFilesReply:
        sb = self._get(req.sandbox_id)
        async with sb.lock:
            sb.ensure_alive()
            try:
                total = await self._maybe_thread(
                    files.write_files, sb.roots, req.files, self.cfg.sandbox_uid, self.cfg.sandbox_gid,
                    big=sum(len(f.data) for f in req.files) > (1 << 20),
                )
            except backend.LimitReached:
                sb.check_disk(None)
                raise
        return api.WriteFilesReply(run_id=req.run_id, sandbox_id=sb.id, files=len(req.files), bytes=total)

    async def read_files(self, req: api.ReadFilesRequest) -> api.ReadFilesReply:
        sb = self._get(req.sandbox_id)
        limit = self.cfg.default_read_bytes if req.max_bytes is None else req.max_bytes
        if limit > self.cfg.max_output_bytes:
            raise InvalidRequest(f"max_bytes={limit} exceeds the maximum {self.cfg.max_output_bytes}")
        async with sb.lock:
            sb.ensure_alive()
            out = [await self._maybe_thread(files.read_file, sb.roots, p, limit, big=limit > (1 << 20))
                   for p in req.paths]
        return api.ReadFilesReply(run_id=req.run_id, sandbox_id=sb.id, files=out)

    @staticmethod
    async def _maybe_thread(fn, *args, big: bool):  # type: ignore[no-untyped-def]
        return await asyncio.to_thread(fn, *args) if big else fn(*args)

    async def pause(self, req: api.PauseRequest) -> api.PauseReply:
        sb = self._get(req.sandbox_id)
        async with sb.lock:
            sb.ensure_alive()
            if sb.state == "running":
                await sb.cgroup.freeze()
                sb.state = "paused"
                sb.emit(api.Paused())
        return api.PauseReply(run_id=req.run_id, sandbox_id=sb.id, state="paused")

    async def resume(self, req: api.ResumeRequest) -> api.ResumeReply:
        sb = self._get(req.sandbox_id)
        async with sb.lock:
            sb.ensure_alive()
            if sb.state == "paused":
                sb.cgroup.thaw()
                sb.state = "running"
                sb.emit(api.Resumed())
        return api.ResumeReply(run_id=req.run_id, sandbox_id=sb.id, state="running")

    async def _take_snapshot(self, sb: Sandbox) -> tuple[Snapshot, bool]:
        """Snapshot under ``sb.lock``: O(1) layer swap when no exec runs, else freeze + copy."""
        store, _ = self._ready()
        layers, copied = await sb.freeze_layers(store)
        snap = Snapshot(id=common.new_id(f"{self.instance_id}-snap", lambda s: s in self.snapshots),
                        sandbox_id=sb.id, layers=layers, spec=sb.spec)
        store.acquire(layers)
        self.snapshots[snap.id] = snap
        sb.snapshots.add(snap.id)
        sb.emit(api.Snapshotted(snapshot_id=snap.id, copied=copied))
        return snap, copied

    async def snapshot(self, req: api.SnapshotRequest) -> api.SnapshotReply:
        sb = self._get(req.sandbox_id)
        async with sb.lock:
            sb.ensure_alive()
            snap, copied = await self._take_snapshot(sb)
        return api.SnapshotReply(run_id=req.run_id, sandbox_id=sb.id, snapshot_id=snap.id, copied=copied)

    async def fork(self, req: api.ForkRequest) -> api.ForkReply:
        parent_id: str | None = None
        if isinstance(req.source, api.FromSandbox):
            parent = self._get(req.source.sandbox_id)
            parent_id = parent.id
            async with parent.lock:
                parent.ensure_alive()
                snap, _ = await self._take_snapshot(parent)
        else:
            found = self.snapshots.get(req.source.snapshot_id)
            if found is None:
                raise NotFound(f"no snapshot {req.source.snapshot_id} on instance {self.instance_id} "
                               "(it goes when its sandbox is destroyed)")
            snap, parent_id = found, found.sandbox_id
        ttl = common.resolve_ttl(req.lease_ttl_s, snap.spec.lease_ttl_s, self.cfg)
        spec = Spec(base=snap.spec.base, limits=snap.spec.limits, env=snap.spec.env, egress=snap.spec.egress,
                    lease_ttl_s=ttl, labels=dict(req.labels) if req.labels else snap.spec.labels)
        child = await self._new_sandbox(req.run_id, spec, snap.layers, parent_id)
        expires = self.leases.set(child.id, ttl)
        child.emit(api.Forked(snapshot_id=snap.id, parent_id=parent_id, lease_ttl_s=ttl, labels=spec.labels))
        return api.ForkReply(run_id=req.run_id, sandbox_id=child.id, instance_id=self.instance_id,
                             snapshot_id=snap.id, lease_expires_at=expires)

    async def destroy(self, req: api.DestroyRequest) -> api.DestroyReply:
        sb = self._get(req.sandbox_id)
        await self._destroy(sb, "requested")
        return api.DestroyReply(run_id=req.run_id, sandbox_id=sb.id)

    async def _destroy(self, sb: Sandbox, reason: api.DestroyReason, emit: bool = True, wait: bool = False) -> None:
        """Make the sandbox unusable and SIGKILL all it runs at once (:meth:`Sandbox.kill_now`), then emit
        ``destroyed``; waiting for the processes to exit, removing the cgroup and unmounting and deleting the
        volume and layers finish in a background task (:meth:`_release`), which ``close`` waits for. Until it
        ends, the sandbox still counts in :meth:`held` (``max_sandboxes``). If the service dies before, its
        lock goes with it and the next instance on ``root_dir`` reaps what is left (``host.reap_orphans``).
        ``wait``: return once released."""
        async with sb.lock:
            if sb.state == "destroying":
                return
            sb.state = "destroying"
            self.leases.drop(sb.id)
            execs = list(sb.execs.values())
            sb.kill_now()
        snaps = [snap for snap in (self.snapshots.pop(s, None) for s in sb.snapshots) if snap is not None]
        if emit:
            sb.emit(api.Destroyed(reason=reason))
        if wait:
            await self._release(sb, execs, snaps)
        else:
            self._spawn_task(self._release(sb, execs, snaps), f"sandbox-release-{sb.id}")

    async def _release(self, sb: Sandbox, execs: list, snaps: list[Snapshot]) -> None:  # type: ignore[type-arg]
        store, _ = self._ready()
        try:
            await sb.wait_gone(execs)
            doomed = store.drop_tree(sb.tree)
            for snap in snaps:
                doomed += store.release(snap.layers)
            self.sandboxes.pop(sb.id, None)
            if doomed:  # unmounting a tmpfs waits for the kernel (~2 ms here): in a thread, in order
                await asyncio.to_thread(remove_all, doomed)
        except Exception:  # it stays counted (held) until the reaper of the next instance on root_dir takes it
            log.exception("sandbox %s: releasing its processes, cgroup or volume failed", sb.id)
        finally:
            self.pool.wake()

    def _lease_expired(self, sandbox_id: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == "destroying":
            return
        sb.emit(api.LeaseExpired(lease_ttl_s=sb.spec.lease_ttl_s))
        self._spawn_task(self._destroy(sb, "lease_expired"), f"sandbox-expire-{sandbox_id}")

    async def renew_lease(self, req: api.RenewLeaseRequest) -> api.RenewLeaseReply:
        sb = self._get(req.sandbox_id)
        ttl = common.resolve_ttl(req.ttl_s, sb.spec.lease_ttl_s, self.cfg)
        expires = self.leases.set(sb.id, ttl)
        return api.RenewLeaseReply(run_id=req.run_id, sandbox_id=sb.id, lease_expires_at=expires)

    async def list(self, req: api.ListRequest) -> api.ListReply:
        store, _ = self._ready()
        infos = [
            sb.info(self.leases.expires_at(sb.id), store.retained_bytes(sb.tree))
            for sb in self.sandboxes.values()
            if sb.state != "destroying" and not sb.pooled and (req.all_runs or sb.run_id == req.run_id)
        ]
        return api.ListReply(run_id=req.run_id, instance_id=self.instance_id, sandboxes=infos)
