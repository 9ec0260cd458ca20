"""The ``unsafe-process`` backend: the sandbox API with plain host processes and NO isolation.

For development machines without bubblewrap, cgroups or root. Commands run as
the service's own user in a per-sandbox host directory (``HOME`` and the
working directory; ``/workspace`` paths in commands are NOT remapped, use
relative paths or ``$HOME``), with the scrubbed environment, the wall-time
limit and the output caps. There are no memory/pids/CPU limits, no filesystem
or network isolation (egress allowlists are not enforced), pause is SIGSTOP to
each exec's process group, and snapshot/fork copy the directory (O(size)). It
logs a loud warning when it starts and on every create.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proto import sandbox as api
from services.sandbox import common, execio, files
from services.sandbox.backend import BackendUnavailable, Conflict, EventSink, InvalidRequest, NotFound
from services.sandbox.config import LimitsConfig, SandboxConfig

log = logging.getLogger("rlbus.sandbox.unsafe")

WARNING = (
    "UNSAFE sandbox backend 'unsafe-process': commands run as %s on this host with NO isolation "
    "(no namespaces, no filesystem or network confinement, no memory/pids/CPU limits). "
    "Never use it for untrusted code; install bubblewrap and use type = \"bwrap\"."
)


@dataclass
class _Sandbox:
    id: str
    run_id: str
    dir: str
    limits: LimitsConfig
    env: dict[str, str]
    lease_ttl_s: float
    labels: dict[str, str]
    created_at: float
    parent_id: str | None = None
    state: str = "running"
    seq: int = 0
    exec_count: int = 0
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    snapshots: set[str] = field(default_factory=set)

    @property
    def work(self) -> str:
        return os.path.join(self.dir, "work")

    @property
    def tmp(self) -> str:
        return os.path.join(self.dir, "tmp")


class UnsafeProcessBackend:
    """See the module docstring. Same verbs, events and leases as the bwrap backend."""

    def __init__(self, config: SandboxConfig, on_event: EventSink) -> None:
        self.cfg = config
        self.on_event = on_event
        self.instance_id = config.instance_id or common.new_instance_id()
        self.state_dir = os.path.join(config.root_dir, self.instance_id)
        self.sandboxes: dict[str, _Sandbox] = {}
        self.snapshots: dict[str, tuple[str, _Sandbox]] = {}  # id -> (directory, source)
        self.leases = common.LeaseTable(self._lease_expired)
        self._lock = common.InstanceLock(self.state_dir)
        self._tasks: set[asyncio.Task[None]] = set()
        self.pressure: Callable[[], str | None] = lambda: None  # no warm pool in this backend: unread

    def held(self) -> tuple[int, int]:
        return len(self.sandboxes), 0

    def wake_pool(self) -> None:
        """No warm pool in this backend."""

    def gauges(self) -> dict[str, float]:
        return {}

    def _warn(self) -> None:
        log.warning(WARNING, f"uid {os.getuid()}")

    async def start(self) -> list[str]:
        self._warn()
        os.makedirs(self.cfg.root_dir, exist_ok=True)
        reaped = await self.reap_orphans()
        os.makedirs(self.state_dir, exist_ok=True)
        if not self._lock.try_acquire():
            raise BackendUnavailable(f"instance id {self.instance_id} is in use by a live process")
        for sub in ("s", "snap"):
            os.makedirs(os.path.join(self.state_dir, sub), exist_ok=True)
        return reaped

    async def close(self, timeout_s: float | None = None) -> None:
        """Destroy every sandbox; ``timeout_s`` bounds the wait for their background tasks."""
        for sb in list(self.sandboxes.values()):
            await self._destroy(sb, "shutdown")
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self._lock.release()

    async def reap_orphans(self) -> list[str]:
        """Delete directories of dead instances (their processes cannot be found without cgroups)."""
        reaped: list[str] = []
        for entry in os.scandir(self.cfg.root_dir):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            lock = common.InstanceLock(entry.path)
            if not lock.try_acquire(create=False):
                continue
            try:
                sdir = os.path.join(entry.path, "s")
                for sid in sorted(os.listdir(sdir)) if os.path.isdir(sdir) else []:
                    try:
                        with open(os.path.join(sdir, sid, "meta.json")) as f:
                            run_id = json.load(f)["run_id"]
                    except (OSError, ValueError, KeyError):
                        continue
                    reaped.append(sid)
                    self.on_event(api.SandboxEvent(run_id=run_id, sandbox_id=sid, instance_id=entry.name, seq=0,
                                                   detail=api.Destroyed(reason="orphan_reaped")))
                await asyncio.to_thread(shutil.rmtree, entry.path, True)
            finally:
                lock.release()
        return reaped

    def _emit(self, sb: _Sandbox, detail: api.EventDetail) -> None:
        sb.seq += 1
        event = api.SandboxEvent(run_id=sb.run_id, sandbox_id=sb.id, instance_id=self.instance_id, seq=sb.seq,
                                 detail=detail)
        try:
            self.on_event(event)
        except Exception:  # a failing sink must not fail the operation that changed the state
            log.exception("event sink failed on %s of %s", event.kind, sb.id)

    def _get(self, sandbox_id: str) -> _Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == "destroying":
            raise NotFound(f"no sandbox {sandbox_id} on instance {self.instance_id}", sandbox_id)
        return sb

    def _roots(self, sb: _Sandbox) -> files.Roots:
        return files.Roots(workdir=self.cfg.workdir, work_host=sb.work, tmp_host=sb.tmp)

    def _new(self, run_id: str, limits: LimitsConfig, env: dict[str, str], ttl: float, labels: dict[str, str],
             parent_id: str | None, copy_from: str | None) -> _Sandbox:
        common.check_capacity(len(self.sandboxes), self.cfg)
        sid = common.new_id(self.instance_id, lambda s: s in self.sandboxes)
        sb = _Sandbox(id=sid, run_id=run_id, dir=os.path.join(self.state_dir, "s", sid), limits=limits, env=env,
                      lease_ttl_s=ttl, labels=labels, created_at=time.time(), parent_id=parent_id)
        os.makedirs(sb.tmp)
        if copy_from is None:
            os.mkdir(sb.work)
        else:
            shutil.copytree(copy_from, sb.work, symlinks=True)
        with open(os.path.join(sb.dir, "meta.json"), "w") as f:
            json.dump({"sandbox_id": sid, "run_id": run_id}, f)
        self.sandboxes[sid] = sb
        return sb

    async def create(self, req: api.CreateRequest) -> api.CreateReply:
        self._warn()
        if req.base != "host":
            raise InvalidRequest("the unsafe-process backend only has base 'host'")
        if req.egress:
            log.warning("unsafe-process backend: egress allowlist %s is NOT enforced (the network is open)", req.egress)
        sb = self._new(req.run_id, common.resolve_limits(req.limits, self.cfg), common.check_env(dict(req.env)),
                       common.resolve_ttl(req.lease_ttl_s, self.cfg.default_lease_ttl_s, self.cfg), dict(req.labels),
                       None, None)
        try:
            files.write_files(self._roots(sb), req.files, os.getuid(), os.getgid())
        except BaseException:
            self.sandboxes.pop(sb.id, None)
            shutil.rmtree(sb.dir, ignore_errors=True)
            raise
        expires = self.leases.set(sb.id, sb.lease_ttl_s)
        self._emit(sb, api.Created(base="host", limits=api.Limits(memory_mb=sb.limits.memory_mb, pids=sb.limits.pids,
                                                                  cpus=sb.limits.cpus),
                                   egress=list(req.egress), lease_ttl_s=sb.lease_ttl_s, labels=sb.labels))
        return api.CreateReply(run_id=req.run_id, sandbox_id=sb.id, instance_id=self.instance_id,
                               lease_expires_at=expires)

    async def exec(self, req: api.ExecRequest) -> api.ExecReply:
        sb = self._get(req.sandbox_id)
        if sb.state == "paused":
            raise Conflict(f"sandbox {sb.id} is paused: resume it before exec", sb.id)
        timeout = common.resolve_timeout(req, self.cfg)
        cap = common.resolve_output_cap(req, self.cfg)
        argv = common.command_argv(req.command)
        cwd = sb.work
        if req.cwd and req.cwd != self.cfg.workdir:
            root, parts = self._roots(sb).split(req.cwd)
            cwd = os.path.join(root, *parts)
        env = {**self.cfg.env, "HOME": sb.work, "TMPDIR": sb.tmp, **sb.env, **common.check_env(dict(req.env))}
        sb.exec_count += 1
        exec_id = f"{sb.id}-e{sb.exec_count}"
        pipe = asyncio.subprocess.DEVNULL if req.detach else asyncio.subprocess.PIPE
        try:
            proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdin=pipe, stdout=pipe, stderr=pipe,
                                                        start_new_session=True)
        except OSError as e:
            raise InvalidRequest(f"cannot run {argv[0]!r}: {e.strerror}") from None
        sb.procs[exec_id] = proc
        started = time.monotonic()
        self._emit(sb, api.ExecStarted(exec_id=exec_id, argv=[a[:200] for a in argv], detach=req.detach))

        def kill() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        if req.detach:
            async def wait() -> None:
                timed_out = False
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                except TimeoutError:
                    timed_out = True
                    kill()
                    await proc.wait()
                sb.procs.pop(exec_id, None)
                self._emit(sb, api.ExecFinished(exec_id=exec_id, exit_code=execio.exit_code(proc.returncode),
                                                duration_s=time.monotonic() - started, timed_out=timed_out))

            task = asyncio.create_task(wait(), name=f"sandbox-detached-{exec_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return api.ExecReply(run_id=req.run_id, sandbox_id=sb.id, exec_id=exec_id, exit_code=None, detached=True)
        try:
            out = await execio.communicate(proc, req.stdin, cap, timeout or self.cfg.max_timeout_s, kill)
        finally:
            sb.procs.pop(exec_id, None)
        code, duration = execio.exit_code(out.returncode), time.monotonic() - started
        if out.timed_out:
            self._emit(sb, api.Timeout(exec_id=exec_id, timeout_s=timeout or self.cfg.max_timeout_s))
        self._emit(sb, api.ExecFinished(exec_id=exec_id, exit_code=code, duration_s=duration, timed_out=out.timed_out,
                                        stdout_bytes=out.stdout_bytes, stderr_bytes=out.stderr_bytes))
        return api.ExecReply(run_id=req.run_id, sandbox_id=sb.id, exec_id=exec_id, exit_code=code, stdout=out.stdout,
                             stderr=out.stderr, stdout_truncated=out.stdout_truncated,
                             stderr_truncated=out.stderr_truncated, duration_s=duration, timed_out=out.timed_out)

    async def write_files(self, req: api.WriteFilesRequest) -> api.WriteFilesReply:
        sb = self._get(req.sandbox_id)
        total = files.write_files(self._roots(sb), req.files, os.getuid(), os.getgid())
        return api.WriteFilesReply(run_id=req.run_id, sandbox_id=sb.id, files=len(req.files), bytes=total)

    async def read_files(self, req: api.ReadFilesRequest) -> api.ReadFilesReply:
        sb = self._get(req.sandbox_id)
        limit = self.cfg.default_read_bytes if req.max_bytes is None else req.max_bytes
        out = [files.read_file(self._roots(sb), p, limit) for p in req.paths]
        return api.ReadFilesReply(run_id=req.run_id, sandbox_id=sb.id, files=out)

    def _signal(self, sb: _Sandbox, sig: int) -> None:
        for proc in sb.procs.values():
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    async def pause(self, req: api.PauseRequest) -> api.PauseReply:
        sb = self._get(req.sandbox_id)
        if sb.state == "running":
            self._signal(sb, signal.SIGSTOP)
            sb.state = "paused"
            self._emit(sb, api.Paused())
        return api.PauseReply(run_id=req.run_id, sandbox_id=sb.id, state="paused")

    async def resume(self, req: api.ResumeRequest) -> api.ResumeReply:
        sb = self._get(req.sandbox_id)
        if sb.state == "paused":
            self._signal(sb, signal.SIGCONT)
            sb.state = "running"
            self._emit(sb, api.Resumed())
        return api.ResumeReply(run_id=req.run_id, sandbox_id=sb.id, state="running")

    async def _snapshot(self, sb: _Sandbox) -> str:
        snap_id = common.new_id(f"{self.instance_id}-snap", lambda s: s in self.snapshots)
        dst = os.path.join(self.state_dir, "snap", snap_id)
        await asyncio.to_thread(shutil.copytree, sb.work, dst, True)
        self.snapshots[snap_id] = (dst, sb)
        sb.snapshots.add(snap_id)
        self._emit(sb, api.Snapshotted(snapshot_id=snap_id, copied=True))
        return snap_id

    async def snapshot(self, req: api.SnapshotRequest) -> api.SnapshotReply:
        sb = self._get(req.sandbox_id)
        snap_id = await self._snapshot(sb)
        return api.SnapshotReply(run_id=req.run_id, sandbox_id=sb.id, snapshot_id=snap_id, copied=True)

    async def fork(self, req: api.ForkRequest) -> api.ForkReply:
        if isinstance(req.source, api.FromSandbox):
            snap_id = await self._snapshot(self._get(req.source.sandbox_id))
        else:
            snap_id = req.source.snapshot_id
            if snap_id not in self.snapshots:
                raise NotFound(f"no snapshot {snap_id} on instance {self.instance_id}")
        path, src = self.snapshots[snap_id]
        ttl = common.resolve_ttl(req.lease_ttl_s, src.lease_ttl_s, self.cfg)
        labels = dict(req.labels) if req.labels else src.labels
        child = await asyncio.to_thread(self._new, req.run_id, src.limits, src.env, ttl, labels, src.id, path)
        expires = self.leases.set(child.id, ttl)
        self._emit(child, api.Forked(snapshot_id=snap_id, parent_id=src.id, lease_ttl_s=ttl, labels=labels))
        return api.ForkReply(run_id=req.run_id, sandbox_id=child.id, instance_id=self.instance_id,
                             snapshot_id=snap_id, lease_expires_at=expires)

    async def destroy(self, req: api.DestroyRequest) -> api.DestroyReply:
        sb = self._get(req.sandbox_id)
        await self._destroy(sb, "requested")
        return api.DestroyReply(run_id=req.run_id, sandbox_id=sb.id)

    async def _destroy(self, sb: _Sandbox, reason: api.DestroyReason) -> None:
        if sb.state == "destroying":
            return
        sb.state = "destroying"
        self.leases.drop(sb.id)
        self._signal(sb, signal.SIGKILL)
        self._signal(sb, signal.SIGCONT)
        await asyncio.gather(*(p.wait() for p in list(sb.procs.values())))
        doomed = [sb.dir] + [self.snapshots.pop(s)[0] for s in sb.snapshots if s in self.snapshots]
        self.sandboxes.pop(sb.id, None)
        await asyncio.to_thread(lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed])
        self._emit(sb, api.Destroyed(reason=reason))

    def _lease_expired(self, sandbox_id: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == "destroying":
            return
        self._emit(sb, api.LeaseExpired(lease_ttl_s=sb.lease_ttl_s))
        task = asyncio.create_task(self._destroy(sb, "lease_expired"), name=f"sandbox-expire-{sandbox_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def renew_lease(self, req: api.RenewLeaseRequest) -> api.RenewLeaseReply:
        sb = self._get(req.sandbox_id)
        expires = self.leases.set(sb.id, common.resolve_ttl(req.ttl_s, sb.lease_ttl_s, self.cfg))
        return api.RenewLeaseReply(run_id=req.run_id, sandbox_id=sb.id, lease_expires_at=expires)

    async def list(self, req: api.ListRequest) -> api.ListReply:
        infos = [
            api.SandboxInfo(sandbox_id=sb.id, instance_id=self.instance_id, run_id=sb.run_id,
                            state="paused" if sb.state == "paused" else "running", base="host",
                            created_at=sb.created_at, lease_expires_at=self.leases.expires_at(sb.id), layers=0,
                            running_execs=len(sb.procs), parent_id=sb.parent_id, labels=sb.labels)
            for sb in self.sandboxes.values()
            if sb.state != "destroying" and (req.all_runs or sb.run_id == req.run_id)
        ]
        return api.ListReply(run_id=req.run_id, instance_id=self.instance_id, sandboxes=infos)
