"""Pieces both backends share: request validation against the config, ids, leases, the instance lock."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import secrets
import time
from collections.abc import Callable

from proto import sandbox as api
from services.sandbox.backend import InvalidRequest, LimitReached, Overloaded
from services.sandbox.config import LimitsConfig, SandboxConfig


def new_instance_id() -> str:
    return secrets.token_hex(4)


def new_id(prefix: str, taken: Callable[[str], bool]) -> str:
    """``<prefix>-<8 hex>`` not yet ``taken``."""
    while True:
        candidate = f"{prefix}-{secrets.token_hex(4)}"
        if not taken(candidate):
            return candidate


def resolve_limits(asked: api.Limits, cfg: SandboxConfig) -> LimitsConfig:
    """The request's limits with defaults filled in; above the maximum is an error, not a silent clamp."""
    d, m = cfg.default_limits, cfg.max_limits
    limits = LimitsConfig(
        memory_mb=asked.memory_mb if asked.memory_mb is not None else d.memory_mb,
        pids=asked.pids if asked.pids is not None else d.pids,
        cpus=asked.cpus if asked.cpus is not None else d.cpus,
        disk_mb=asked.disk_mb if asked.disk_mb is not None else min(d.disk_mb, asked.memory_mb or d.disk_mb),
        inodes=asked.inodes if asked.inodes is not None else d.inodes,
    )
    for name, value, top in (("memory_mb", limits.memory_mb, m.memory_mb), ("pids", limits.pids, m.pids),
                             ("cpus", limits.cpus, m.cpus), ("disk_mb", limits.disk_mb, m.disk_mb),
                             ("inodes", limits.inodes, m.inodes)):
        if value > top:
            raise InvalidRequest(f"limits.{name}={value} exceeds this service's maximum {top}")
    return limits


def api_limits(limits: LimitsConfig) -> api.Limits:
    """The concrete limits as the wire form (events, replies)."""
    return api.Limits(memory_mb=limits.memory_mb, pids=limits.pids, cpus=limits.cpus, disk_mb=limits.disk_mb,
                      inodes=limits.inodes)


def resolve_ttl(asked: float | None, default: float, cfg: SandboxConfig) -> float:
    ttl = asked if asked is not None else default
    if ttl > cfg.max_lease_ttl_s:
        raise InvalidRequest(f"lease_ttl_s={ttl} exceeds the maximum {cfg.max_lease_ttl_s}; renew the lease instead")
    return ttl


def resolve_timeout(req: api.ExecRequest, cfg: SandboxConfig) -> float | None:
    """Wall-time limit of an exec: the request's, else the default (none for detached execs)."""
    if req.timeout_s is None:
        return None if req.detach else cfg.default_timeout_s
    if req.timeout_s > cfg.max_timeout_s:
        raise InvalidRequest(f"timeout_s={req.timeout_s} exceeds the maximum {cfg.max_timeout_s}")
    return req.timeout_s


def resolve_output_cap(req: api.ExecRequest, cfg: SandboxConfig) -> int:
    if req.max_output_bytes is None:
        return cfg.default_max_output_bytes
    if req.max_output_bytes > cfg.max_output_bytes:
        raise InvalidRequest(f"max_output_bytes={req.max_output_bytes} exceeds the maximum {cfg.max_output_bytes}")
    return req.max_output_bytes


def check_env(env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidRequest(f"environment variable {k!r} has an invalid name or value")
    return env


def command_argv(command: api.Command) -> list[str]:
    if isinstance(command, api.Argv):
        argv = list(command.args)
    else:
        argv = [command.shell, "-c", command.script]
    if any("\0" in a for a in argv):
        raise InvalidRequest("command arguments may not contain NUL bytes")
    return argv


def check_capacity(count: int, cfg: SandboxConfig) -> None:
    bound = cfg.sandboxes_bound()
    if count >= bound:
        raise Overloaded(f"this instance holds {count} sandboxes (max_sandboxes = {bound}); try again, destroy "
                         "some or add instances", retry_after_s=cfg.overload_retry_after_s)


def check_memory(used_mb: float, limits: LimitsConfig, cfg: SandboxConfig) -> None:
    """Refuse a new sandbox that could take the instance past its memory budget (``used_mb``: its working set)."""
    budget = cfg.memory_budget()
    need = limits.memory_mb + limits.disk_mb
    if need > budget:
        raise LimitReached(f"a sandbox of memory_mb + disk_mb = {need} MiB exceeds this instance's memory budget "
                           f"({budget} MiB, memory_budget_mb): ask for less")
    if used_mb + need > budget:
        raise Overloaded(f"the instance's sandboxes use {used_mb:.0f} MiB of its {budget} MiB memory budget "
                         f"(memory_budget_mb) and this sandbox may take {need} MiB more; try again, destroy some "
                         "or add instances", retry_after_s=cfg.overload_retry_after_s)


class LeaseTable:
    """Lease deadlines as event-loop timers: no polling; ``on_expire(sandbox_id)`` runs when one passes."""

    def __init__(self, on_expire: Callable[[str], None]) -> None:
        self._on_expire = on_expire
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._expires_at: dict[str, float] = {}

    def set(self, sandbox_id: str, ttl_s: float) -> float:
        """(Re)start the lease; returns its expiry as wall-clock seconds."""
        self.drop(sandbox_id)
        loop = asyncio.get_running_loop()
        self._timers[sandbox_id] = loop.call_later(ttl_s, self._fire, sandbox_id)
        self._expires_at[sandbox_id] = time.time() + ttl_s
        return self._expires_at[sandbox_id]

    def _fire(self, sandbox_id: str) -> None:
        self._timers.pop(sandbox_id, None)
        self._expires_at.pop(sandbox_id, None)
        self._on_expire(sandbox_id)

    def expires_at(self, sandbox_id: str) -> float:
        return self._expires_at.get(sandbox_id, 0.0)

    def drop(self, sandbox_id: str) -> None:
        timer = self._timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        self._expires_at.pop(sandbox_id, None)


class InstanceLock:
    """``<root>/<instance>/lock``, flock-ed for the life of the instance.

    The kernel drops the lock when the process dies however it dies, so another
    instance that can take the lock knows the owner is gone (no pid reuse issues).
    """

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "lock")
        self.fd: int | None = None

    def try_acquire(self, create: bool = True) -> bool:
        """Take the lock; False when another live process holds it (or, without ``create``, no lock file)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
