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


class Layers:
    """The layer store of one instance (``<state>/l``) and the work trees built on it."""

    def __init__(self, state_dir: str, uid: int, gid: int, max_layers: int) -> None:
        self.layer_dir = os.path.join(state_dir, "l")
        self.empty = os.path.join(state_dir, "e")
        self.uid, self.gid = uid, gid
        self.max_layers = max_layers
        self.refs: dict[str, int] = {}
        os.makedirs(self.layer_dir, exist_ok=True)
        os.makedirs(self.empty, exist_ok=True)

    def path(self, layer: str) -> str:
        return os.path.join(self.layer_dir, layer)

    def acquire(self, layers: tuple[str, ...]) -> None:
        for layer in layers:
            self.refs[layer] = self.refs.get(layer, 0) + 1

    def release(self, layers: tuple[str, ...]) -> list[str]:
        """Drop one reference to each layer; returns the directories of layers nobody uses any more."""
        dead = []
        for layer in layers:
            n = self.refs.get(layer, 0) - 1
            if n <= 0:
                self.refs.pop(layer, None)
                dead.append(self.path(layer))
            else:
                self.refs[layer] = n
        return dead

    def _fresh_upper(self, tree: WorkTree) -> None:
        os.mkdir(tree.upper, 0o755)
        os.chown(tree.upper, self.uid, self.gid)
        os.mkdir(tree.work, 0o700)

    def _mount(self, tree: WorkTree) -> None:
        lowers = [self.path(layer) for layer in tree.layers] + [self.empty]
        mount_overlay(tree.merged, lowers, tree.upper, tree.work)
        tree.mounted = True

    def new_tree(self, dir: str, layers: tuple[str, ...]) -> WorkTree:
        """Directories and overlay mount of a new sandbox on ``layers``."""
        tree = WorkTree(dir=dir, layers=layers)
        os.mkdir(dir, 0o711)
        try:
            os.mkdir(tree.merged, 0o755)
            os.mkdir(tree.tmp, 0o1777)
            os.chown(tree.tmp, self.uid, self.gid)
            os.chmod(tree.tmp, 0o1777)
            self._fresh_upper(tree)
            self._mount(tree)
        except BaseException:
            rmtree(dir)
            raise
        self.acquire(layers)
        return tree

    def upper_is_empty(self, tree: WorkTree) -> bool:
        with os.scandir(tree.upper) as it:
            return next(it, None) is None

    def _new_layer_id(self) -> str:
        while True:
            layer = secrets.token_hex(4)
            if not os.path.exists(self.path(layer)):
                return layer

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
        layer = self._new_layer_id()
        old_work = tree.work
        umount(tree.merged)
        tree.mounted = False
        os.rename(tree.upper, self.path(layer))
        self.acquire((layer,))  # the sandbox's own reference (taken over from the upper)
        tree.layers = (layer, *tree.layers)
        tree.gen += 1
        self._fresh_upper(tree)
        self._mount(tree)
        rmtree(old_work)
        return tree.layers

    async def copy_upper(self, tree: WorkTree) -> tuple[str, ...]:
        """Snapshot by copy (the caller has frozen the sandbox); the sandbox keeps its mount."""
        self._check_depth(tree)
        layer = self._new_layer_id()
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
            raise SandboxFailure(f"copying the writable layer for a snapshot failed: {err.decode(errors='replace')}")
        os.chown(dst, self.uid, self.gid)
        return (layer, *tree.layers)

    def drop_tree(self, tree: WorkTree) -> list[str]:
        """Unmount a sandbox's tree; returns directories to delete (the tree and unused layers)."""
        if tree.mounted:
            umount(tree.merged)
            tree.mounted = False
        return [tree.dir, *self.release(tree.layers)]
