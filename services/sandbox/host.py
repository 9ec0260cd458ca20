"""Host-side helpers of the bwrap backend: prerequisite checks, base roots, orphan reaping."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import select
import shutil
import signal
import stat
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

from proto import sandbox as api
from services.sandbox import common
from services.sandbox.backend import BackendUnavailable, EventSink
from services.sandbox.cgroups import Hierarchy
from services.sandbox.config import SandboxConfig
from services.sandbox.etc import etc_args
from services.sandbox.overlay import mounts_under, rmtree, umount

log = logging.getLogger("rlbus.sandbox.host")

APT_HINT = "apt-get update && apt-get install -y bubblewrap"


def _traversable(path: str, uid: int, gid: int) -> bool:
    """Can ``uid``/``gid`` reach ``path`` (search permission on it and every ancestor)?"""
    current = "/"
    for part in [p for p in path.split("/") if p] + [None]:
        st = os.stat(current)
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return False
        if part is None:
            return True
        current = os.path.join(current, part)
    return True


def check_prerequisites(cfg: SandboxConfig) -> Hierarchy:
    """Everything the bwrap backend needs, or one :class:`BackendUnavailable` listing all that is missing."""
    check_sandbox_python(cfg)
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("the service must run as root (overlay mounts, cgroups, dropping to sandbox_uid)")
    if shutil.which(cfg.bwrap_path) is None:
        problems.append(f"bubblewrap ({cfg.bwrap_path}) is not installed: {APT_HINT}")
    if shutil.which(cfg.setpriv_path) is None:
        problems.append(f"setpriv ({cfg.setpriv_path}, package util-linux) is not installed")
    try:
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                problems.append("overlayfs is not available: modprobe overlay")
    except OSError:
        problems.append("/proc is not mounted")
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read()) == 0:
                problems.append("user namespaces are disabled: sysctl -w user.max_user_namespaces=100000")
    except FileNotFoundError:
        problems.append("the kernel has no user namespaces")
    if any(ch in cfg.root_dir for ch in ":,\\ "):
        problems.append(f"root_dir {cfg.root_dir!r} may not contain ':', ',', '\\' or spaces (overlay options)")
    hierarchy = None
    try:
        hierarchy = Hierarchy.detect(cfg.cgroup_parent)
    except BackendUnavailable as e:
        problems.append(str(e))
    for name, path in cfg.images.items():
        if not os.path.exists(path):
            problems.append(f"image {name!r}: {path} does not exist (a root filesystem directory, an OCI "
                            "image layout or an OCI archive)")
    if not problems:
        os.makedirs(cfg.root_dir, mode=0o711, exist_ok=True)
        if not _traversable(cfg.root_dir, cfg.sandbox_uid, cfg.sandbox_gid):
            problems.append(
                f"root_dir {cfg.root_dir} is not reachable by sandbox_uid {cfg.sandbox_uid}: "
                "every directory on its path needs o+x (chmod o+x), or choose another root_dir"
            )
    if problems or hierarchy is None:
        raise BackendUnavailable(
            "the bwrap sandbox backend cannot start: " + "; ".join(problems)
            + '. Fix these, or set services.sandbox.type = "unsafe-process" to run WITHOUT isolation '
            "(development only)"
        )
    return hierarchy


def python_package_dirs(cfg: SandboxConfig) -> list[str]:
    """The site-packages directories of this service's Python that sandboxes see (``python_packages``)."""
    if not cfg.python_packages:
        return []
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


#: where sandboxes see this Python's site-packages (``python_packages``): a top-level directory of its own, so
#: the sandbox's /tmp, /dev/shm and work directory never hide them (a virtual environment under /tmp would be)
SANDBOX_PACKAGES = "/.rlbus-python"


def python_package_mounts(cfg: SandboxConfig) -> list[tuple[str, str]]:
    """``(host directory, path inside the sandbox)`` of each ``python_packages`` directory."""
    return [(d, f"{SANDBOX_PACKAGES}/{i}") for i, d in enumerate(python_package_dirs(cfg))]


def python_env(cfg: SandboxConfig) -> dict[str, str]:
    """What every exec's environment gets for ``python_packages`` (nothing when it is off)."""
    inside = [path for _, path in python_package_mounts(cfg)]
    return {"PYTHONPATH": ":".join(inside)} if inside else {}


def check_sandbox_python(cfg: SandboxConfig) -> None:
    """With ``python_packages``, the host's ``python3`` (what sandboxes run) must be this Python's minor
    version, or the packages' compiled modules would not load: raises BackendUnavailable naming both."""
    if not cfg.python_packages:
        return
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = next((os.path.realpath(os.path.join(d, "python3")) for d in ("/usr/bin", "/usr/local/bin", "/bin")
                  if os.path.exists(os.path.join(d, "python3"))), None)
    if found is None or not os.path.basename(found).startswith(want):
        raise BackendUnavailable(
            f"python_packages = true: sandboxes run {found or 'no python3'}, but this service's packages are for "
            f"{want}; install {want} on the host or turn python_packages off")


def base_args(cfg: SandboxConfig, base: str, etc_dir: str, image_root: str = "") -> list[str]:
    """bwrap arguments building the read-only base root named ``base``.

    bwrap's own root is a tmpfs; the base's top-level entries are bound into it
    one by one (read-only), so the mount points bwrap adds (/dev, /proc, /tmp,
    the work directory) never need creating inside a read-only tree. An image's
    top-level entries are read when the backend starts (``image_root``: the image's
    root filesystem, see ``images.py``). Base ``"host"`` gets the synthesized /etc in
    ``etc_dir`` unless ``host_paths`` names "/etc".
    """
    if base == "host":
        paths = [*((p, p) for p in cfg.host_paths), *python_package_mounts(cfg)]
    else:
        image = image_root or cfg.images[base]
        skip = {"dev", "proc", "tmp", cfg.workdir.strip("/").split("/")[0]}
        paths = [(os.path.join(image, name), "/" + name) for name in sorted(os.listdir(image)) if name not in skip]
    args: list[str] = []
    for src, dest in paths:
        if os.path.islink(src):
            args += ["--symlink", os.readlink(src), dest]
        elif os.path.exists(src):
            args += ["--ro-bind", src, dest]
    if base == "host" and "/etc" not in cfg.host_paths:
        args += etc_args(etc_dir)
    return args


def kill_pidfd(pidfd: int) -> None:
    """SIGKILL the process behind ``pidfd`` (a pid namespace's pid 1: the whole namespace dies); gone already is
    fine."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


#: how often a wait on a descriptor also looks at it itself: the event loop's wake-up is the fast path, the look the
#: backstop, so a wake-up that never comes (see :func:`add_fresh_reader`) costs a second, not a destroy that hangs
RECHECK_S = 1.0


def add_fresh_reader(loop: asyncio.AbstractEventLoop, fd: int, callback: Callable[[], None]) -> None:
    """``loop.add_reader`` for a descriptor no one else on this loop watches (one just opened, or owned by the caller).

    The loop's selector may still hold this number for a descriptor that some code closed without unregistering
    it. asyncio would then only swap the callback, and the kernel would never report the new descriptor: the wait
    hangs. Such a stale entry is dropped first, and said, so the fresh registration reaches the kernel."""
    stale = loop.remove_reader(fd)
    stale = loop.remove_writer(fd) or stale
    if stale:
        log.warning("fd %d was still registered with the event loop: a descriptor closed without remove_reader/"
                    "remove_writer (a stale entry, now dropped) or a second waiter on it (which finds its end by "
                    "its own look each %.0f s)", fd, RECHECK_S)
    loop.add_reader(fd, callback)


def readable_now(fd: int) -> bool:
    """Whether ``fd`` is readable at this instant (asked of the kernel directly, not through the event loop)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    events = sum(e for _, e in poller.poll(0))
    if events & select.POLLNVAL:
        raise OSError(errno.EBADF, f"fd {fd} is not open (closed under its waiter)")
    return bool(events & (select.POLLIN | select.POLLHUP))


async def _watch_until(fd: int, on_readable: Callable[[], None], done: asyncio.Future[Any],
                       timeout_s: float | None = None) -> bool:
    """Call ``on_readable`` whenever ``fd`` turns readable, until ``done`` is done (True) or ``timeout_s`` passed
    (False). The event loop's wake-up is the fast path; a direct look every :data:`RECHECK_S` is the backstop, and
    says when it found what the loop missed."""
    loop = asyncio.get_running_loop()
    end = None if timeout_s is None else loop.time() + timeout_s
    add_fresh_reader(loop, fd, on_readable)
    try:
        while not done.done():
            wait = RECHECK_S if end is None else min(RECHECK_S, end - loop.time())
            if wait <= 0:
                return False
            await asyncio.wait({done}, timeout=wait)
            if not done.done() and readable_now(fd):
                log.warning("fd %d turned readable but the event loop did not say so; found by the backstop look", fd)
                on_readable()
        return True
    finally:
        loop.remove_reader(fd)


async def read_to_eof(fd: int) -> bytes:
    """Read a pipe until its writers close it, without blocking the event loop; closes ``fd``."""
    done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    chunks: list[bytes] = []
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            while True:
                chunk = os.read(fd, 4096)
                if not chunk:
                    if not done.done():
                        done.set_result(b"".join(chunks))
                    return
                chunks.append(chunk)
        except BlockingIOError:
            return
        except OSError as e:
            if not done.done():
                done.set_exception(e)

    try:
        await _watch_until(fd, readable, done)
        return done.result()
    finally:
        os.close(fd)


async def wait_exited(pidfd: int, timeout_s: float) -> bool:
    """Wait until the process behind ``pidfd`` has exited (a pidfd turns readable then); False on timeout.
    An exit the event loop missed is found within :data:`RECHECK_S` (:func:`_watch_until`)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    return await _watch_until(pidfd, readable, done, timeout_s)


async def reap_instance(
    cfg: SandboxConfig, hierarchy: Hierarchy, instance: str, on_event: EventSink, *, keep_dir: bool
) -> list[str]:
    """Kill, unmount and delete everything of ``instance`` (whose lock the caller holds).

    Emits ``destroyed`` (reason ``orphan_reaped``, seq 0) for each sandbox that
    still had its metadata. With ``keep_dir`` the instance directory and its lock
    file stay. Returns the sandbox ids, less those of its warm pool (never anyone's).
    """
    state_dir = os.path.join(cfg.root_dir, instance)
    metas: dict[str, str] = {}
    pooled: set[str] = set()
    sandboxes_dir = os.path.join(state_dir, "s")
    try:
        for entry in os.scandir(sandboxes_dir):
            try:
                with open(os.path.join(entry.path, "meta.json")) as f:
                    meta = json.load(f)
                metas[entry.name] = meta["run_id"]
                if meta.get("pooled"):
                    pooled.add(entry.name)
            except (OSError, ValueError, KeyError, AttributeError):
                metas.setdefault(entry.name, "")
    except FileNotFoundError:
        pass
    killed = await hierarchy.remove_instance(instance)
    for mp in mounts_under(state_dir):
        umount(mp)
    if keep_dir:
        for name in ("s", "l", "e"):
            path = os.path.join(state_dir, name)
            if os.path.exists(path):
                await asyncio.to_thread(rmtree, path)
    elif os.path.exists(state_dir):
        await asyncio.to_thread(rmtree, state_dir)
    ids = sorted((set(metas) | set(killed)) - pooled)
    for sid in ids:
        if metas.get(sid):
            on_event(api.SandboxEvent(
                run_id=metas[sid], sandbox_id=sid, instance_id=instance, seq=0,
                detail=api.Destroyed(reason="orphan_reaped"),
            ))
    if ids or pooled:
        log.warning("reaped instance %s: %d sandboxes (and %d of its warm pool)", instance, len(ids), len(pooled))
    return ids


async def reap_orphans(cfg: SandboxConfig, hierarchy: Hierarchy, instance_id: str, on_event: EventSink) -> list[str]:
    """Destroy sandboxes of dead instances under ``root_dir``; returns their ids."""
    reaped: list[str] = []
    try:
        entries = [e.name for e in os.scandir(cfg.root_dir) if e.is_dir()]
    except FileNotFoundError:
        return reaped
    for name in entries:
        if name == instance_id or (name.startswith(".") and not name.startswith(".new-")):
            continue
        lock = common.InstanceLock(os.path.join(cfg.root_dir, name))
        if not lock.try_acquire(create=False):
            continue  # alive (or not an instance directory)
        if name.startswith(".new-"):  # an instance that died while starting
            rmtree(os.path.join(cfg.root_dir, name))
            lock.release()
            continue
        try:
            reaped += await reap_instance(cfg, hierarchy, name, on_event, keep_dir=False)
        finally:
            lock.release()
    if reaped:
        log.warning("reaped %d orphaned sandboxes of dead instances", len(reaped))
    return reaped
