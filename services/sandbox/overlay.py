"""The work directory as a stack of overlayfs layers, so snapshot and fork cost O(1).

A sandbox's work directory is an overlay mount: read-only layers (oldest at the
bottom, an empty directory under everything) and one writable upper layer.

* **snapshot** of a sandbox with no process running: unmount, move the upper
  directory into the layer store (a rename), mount again with that layer on top
  of the stack and a fresh empty upper. Nothing is copied. If the upper is empty,
  the snapshot is the current stack and no layer is added.
* **snapshot** while processes run (they hold the old mount in their own mount
  namespaces, so the upper cannot be swapped under them): the caller freezes
  the sandbox and :meth:`Layers.copy_upper` copies the upper into a new layer
  (O(size of the changes since the last snapshot)).
* **fork**: a new sandbox whose stack is the snapshot's layers plus its own fresh
  upper. Parent and child never share a writable layer.

Layers are reference-counted by the sandboxes and snapshots that use them and
deleted when the last one goes. Mounts go through ``mount(2)`` directly
(``ctypes``): no ``mount`` process per sandbox.

**Disk and inode quotas.** Each sandbox's directory is a *volume*: a tmpfs mounted with
``size=<disk_mb>m,nr_inodes=<inodes>``, holding its upper/work directories, its /tmp and every
layer its snapshots make (a snapshot renames the upper within the volume; a copying snapshot
copies into it). So everything a sandbox can write is bounded by the kernel (ENOSPC inside),
never reaches the host's disk, and its pages are charged to the memory cgroup of the process
that wrote them (the sandbox's, for its own writes). A fork gets a volume of its own for its
upper and reads its parent's layers from the parent's volume, which stays mounted, after the
parent is destroyed, until the last layer in it is released. The kernel here has no quota
support (``CONFIG_QUOTA`` is off), which rules out project quotas; a loop-mounted image per
sandbox costs a loop device and an mkfs each; a tmpfs mount costs tens of microseconds.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field

from services.sandbox.backend import LimitReached, SandboxFailure

log = logging.getLogger("rlbus.sandbox.overlay")

_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2
MS_NOSUID, MS_NODEV = 2, 4
#: inodes and bytes of a volume the service itself uses (the directories m, t, u0, w0, meta.json)
VOLUME_OVERHEAD_INODES = 16
VOLUME_OVERHEAD_BYTES = 64 * 1024
#: the legacy mount(2) data page; the lowerdir list must fit in it
MAX_MOUNT_DATA = 4000
_volatile_ok = True


def mount_overlay(target: str, lowers: list[str], upper: str, work: str) -> None:
    """Mount an overlay at ``target`` (lowers top first). Uses ``volatile`` (no fsync) when the kernel has it."""
    global _volatile_ok
    base = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    if len(base) > MAX_MOUNT_DATA:
        raise LimitReached(f"overlay mount options are {len(base)} bytes (> {MAX_MOUNT_DATA}): too many layers")
    for opts in ([base + ",volatile", base] if _volatile_ok else [base]):
        if _libc.mount(b"overlay", target.encode(), b"overlay", 0, opts.encode()) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EINVAL and opts.endswith(",volatile"):
            _volatile_ok = False
            continue
        raise SandboxFailure(f"mounting overlay at {target} failed: {os.strerror(err)} (options {opts})")


def mount_tmpfs(target: str, size_bytes: int, inodes: int) -> None:
    """Mount a size- and inode-limited tmpfs at ``target`` (nosuid, nodev)."""
    opts = f"size={size_bytes},nr_inodes={inodes},mode=0711"
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxFailure(f"mounting a tmpfs at {target} failed: {os.strerror(err)} (options {opts})")


def umount(target: str) -> None:
    """Lazily unmount ``target`` (processes still inside keep their view until they exit)."""
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point (already gone)
            raise SandboxFailure(f"unmounting {target} failed: {os.strerror(err)}")


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix``, deepest first (for unmounting what a crash left)."""
    prefix = prefix.rstrip("/")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == prefix or mp.startswith(prefix + "/"):
                found.append(mp)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def rmtree(path: str) -> None:
    """Remove a directory tree, including overlay work dirs (mode 000, owned by root)."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        raise SandboxFailure(f"could not remove {path}")


@dataclass
class Volume:
    """A sandbox's tmpfs: lives while its sandbox does or any layer in it is used (see the module docstring)."""

    dir: str
    tree_alive: bool = True
    layers: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Doomed:
    """Something to delete once a sandbox or layer is gone: a directory tree, or a volume to unmount."""

    path: str
    unmount: bool = False

    def remove(self) -> None:
        if self.unmount:
            umount(self.path)  # lazily: the tmpfs and everything in it is freed when the last user goes
            os.rmdir(self.path)
        elif os.path.isdir(self.path) and not os.path.islink(self.path):
            rmtree(self.path)
        else:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def remove_all(doomed: list[Doomed]) -> None:
    """Remove each in order; a failure is logged (the reaper of a later start collects what is left)."""
    for d in doomed:
        try:
            d.remove()
        except (OSError, SandboxFailure) as e:
            log.warning("could not remove %s: %s", d.path, e)


@dataclass
class WorkTree:
    """One sandbox's directories: ``m`` (the overlay mount), ``u<gen>``/``w<gen>`` (upper/work), ``t`` (/tmp)."""

    dir: str
    #: read-only layer ids, top first
    layers: tuple[str, ...]
    gen: int = 0
    mounted: bool = field(default=False)

    @property
    def merged(self) -> str:
        return os.path.join(self.dir, "m")

    @property
    def upper(self) -> str:
        return os.path.join(self.dir, f"u{self.gen}")

    @property
    def work(self) -> str:
        return os.path.join(self.dir, f"w{self.gen}")

    @property
    def tmp(self) -> str:
        return os.path.join(self.dir, "t")

    @property
    def shm(self) -> str:
        """The sandbox's /dev/shm: in its volume, so within its disk and inode quotas."""
        return os.path.join(self.dir, "shm")


class Layers:
    """The layers of one instance and the work trees built on them; each tree in a volume of its own."""

    def __init__(self, state_dir: str, uid: int, gid: int, max_layers: int) -> None:
        self.empty = os.path.join(state_dir, "e")
        self.uid, self.gid = uid, gid
        self.max_layers = max_layers
        self.refs: dict[str, int] = {}
        #: layer id -> the volume (sandbox directory) it lives in
        self.home: dict[str, Volume] = {}
        self.volumes: dict[str, Volume] = {}
        os.makedirs(self.empty, exist_ok=True)

    def path(self, layer: str) -> str:
        return os.path.join(self.home[layer].dir, f"l{layer}")

    def acquire(self, layers: tuple[str, ...]) -> None:
        for layer in layers:
            self.refs[layer] = self.refs.get(layer, 0) + 1

    def release(self, layers: tuple[str, ...]) -> list[Doomed]:
        """Drop one reference to each layer; returns what to delete (layers nobody uses, volumes left empty)."""
        dead: list[Doomed] = []
        for layer in layers:
            n = self.refs.get(layer, 0) - 1
            if n > 0:
                self.refs[layer] = n
                continue
            self.refs.pop(layer, None)
            vol = self.home.pop(layer)
            vol.layers.discard(layer)
            if vol.tree_alive or vol.layers:
                dead.append(Doomed(os.path.join(vol.dir, f"l{layer}")))
            else:  # the volume's sandbox is gone and this was its last layer in use: the whole tmpfs goes
                del self.volumes[vol.dir]
                dead.append(Doomed(vol.dir, unmount=True))
        return dead

    def _fresh_upper(self, tree: WorkTree) -> None:
        os.mkdir(tree.upper, 0o755)
        os.chown(tree.upper, self.uid, self.gid)
        os.mkdir(tree.work, 0o700)

    def _mount(self, tree: WorkTree) -> None:
        lowers = [self.path(layer) for layer in tree.layers] + [self.empty]
        mount_overlay(tree.merged, lowers, tree.upper, tree.work)
        tree.mounted = True

    def new_tree(self, dir: str, layers: tuple[str, ...], disk_mb: int, inodes: int) -> WorkTree:
        """Volume, directories and overlay mount of a new sandbox on ``layers``: ``disk_mb`` MiB and ``inodes``
        files for everything it writes."""
        tree = WorkTree(dir=dir, layers=layers)
        os.mkdir(dir, 0o711)
        try:
            mount_tmpfs(dir, (disk_mb << 20) + VOLUME_OVERHEAD_BYTES, inodes + VOLUME_OVERHEAD_INODES)
        except BaseException:
            os.rmdir(dir)
            raise
        try:
            os.mkdir(tree.merged, 0o755)
            for shared in (tree.tmp, tree.shm):
                os.mkdir(shared, 0o1777)
                os.chown(shared, self.uid, self.gid)
                os.chmod(shared, 0o1777)
            self._fresh_upper(tree)
            self._mount(tree)
        except BaseException:
            if tree.mounted:
                umount(tree.merged)
            Doomed(dir, unmount=True).remove()
            raise
        self.volumes[dir] = Volume(dir)
        self.acquire(layers)
        return tree

    def upper_is_empty(self, tree: WorkTree) -> bool:
        with os.scandir(tree.upper) as it:
            return next(it, None) is None

    def _new_layer(self, tree: WorkTree) -> str:
        """A fresh layer id, homed in ``tree``'s volume."""
        while True:
            layer = secrets.token_hex(4)
            if layer not in self.home:
                vol = self.volumes[tree.dir]
                self.home[layer] = vol
                vol.layers.add(layer)
                return layer

    def _forget(self, layer: str) -> None:
        vol = self.home.pop(layer)
        vol.layers.discard(layer)

    def _check_depth(self, tree: WorkTree) -> None:
        if len(tree.layers) + 1 > self.max_layers:
            raise LimitReached(
                f"the sandbox has {len(tree.layers)} layers (max_layers={self.max_layers}): "
                "fork it into a fresh sandbox less often, or raise max_layers"
            )

    def swap_upper(self, tree: WorkTree) -> tuple[str, ...]:
        """O(1) snapshot of a sandbox with no process running; returns the snapshot's stack (top first)."""
        if self.upper_is_empty(tree):
            return tree.layers
        self._check_depth(tree)
        layer = self._new_layer(tree)
        old_work = tree.work
        umount(tree.merged)
        tree.mounted = False
        os.rename(tree.upper, self.path(layer))  # within the volume: a rename, nothing copied
        self.acquire((layer,))  # the sandbox's own reference (taken over from the upper)
        tree.layers = (layer, *tree.layers)
        tree.gen += 1
        self._fresh_upper(tree)
        self._mount(tree)
        rmtree(old_work)
        return tree.layers

    async def copy_upper(self, tree: WorkTree) -> tuple[str, ...]:
        """Snapshot by copy (the caller has frozen the sandbox) into the sandbox's volume; it keeps its mount."""
        self._check_depth(tree)
        layer = self._new_layer(tree)
        dst = self.path(layer)
        os.mkdir(dst)
        # cp -a keeps owners, modes, xattrs (overlay's opaque markers) and whiteouts (device nodes)
        proc = await asyncio.create_subprocess_exec(
            "cp", "-a", "--", f"{tree.upper}/.", dst,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            rmtree(dst)
            self._forget(layer)
            why = err.decode(errors="replace").strip()
            if "No space left" in why:
                raise LimitReached("a snapshot while processes run copies the sandbox's changes, and the copy does "
                                   "not fit in its disk quota: snapshot it with no exec running (O(1), no copy), "
                                   "or ask for more disk_mb/inodes")
            raise SandboxFailure(f"copying the writable layer for a snapshot failed: {why}")
        os.chown(dst, self.uid, self.gid)
        return (layer, *tree.layers)

    def drop_tree(self, tree: WorkTree) -> list[Doomed]:
        """Unmount a sandbox's tree; returns what to delete: its volume (or, while layers in the volume are still
        used by forks or snapshots, the tree's own directories in it) and layers nobody uses any more."""
        if tree.mounted:
            umount(tree.merged)
            tree.mounted = False
        vol = self.volumes[tree.dir]
        vol.tree_alive = False
        doomed = self.release(tree.layers)
        if tree.dir not in self.volumes:  # its last layer went with the release: the whole volume is doomed
            return doomed
        if not vol.layers:
            del self.volumes[tree.dir]
            return [*doomed, Doomed(tree.dir, unmount=True)]
        names = ("m", "t", "shm", f"u{tree.gen}", f"w{tree.gen}", "meta.json")
        return [*doomed, *(Doomed(os.path.join(tree.dir, n)) for n in names)]

    def retained_bytes(self, tree: WorkTree) -> int:
        """Bytes of files in the volumes of destroyed sandboxes that ``tree``'s layers keep alive (each volume
        once): memory a fork holds beyond its own, charged to the instance until the last user goes."""
        seen: dict[str, int] = {}
        for layer in tree.layers:
            vol = self.home.get(layer)
            if vol is None or vol.tree_alive or vol.dir in seen:
                continue
            try:
                st = os.statvfs(vol.dir)
                seen[vol.dir] = (st.f_blocks - st.f_bfree) * st.f_frsize
            except OSError:
                seen[vol.dir] = 0
        return sum(seen.values())

    def disk_use(self, tree: WorkTree) -> tuple[int, int]:
        """Free bytes and free inodes in the sandbox's volume."""
        st = os.statvfs(tree.dir)
        return st.f_bavail * st.f_frsize, st.f_favail
