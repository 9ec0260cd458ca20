"""Reading and writing sandbox files from the host without following the sandbox's symlinks.

The service writes into a sandbox's work directory from outside (as root), so a
path must never lead out of it: ``..`` is refused and every component is opened
with ``O_NOFOLLOW`` relative to its parent's descriptor, so a symlink the
sandbox planted (``/workspace/x -> /etc``) fails with an error instead of being
followed on the host. Files are opened non-blocking and must be regular files
(a FIFO cannot hang the service).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from proto import sandbox as api
from services.sandbox.backend import InvalidRequest, LimitReached

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Roots:
    """Where sandbox paths land on the host: the work directory and /tmp."""

    #: the sandbox's work directory as seen inside (``/workspace``)
    workdir: str
    #: host directory holding the work directory's contents (the overlay mount)
    work_host: str
    #: host directory behind the sandbox's /tmp
    tmp_host: str

    def split(self, path: str) -> tuple[str, list[str]]:
        """(host root, components below it) for a sandbox path; refuses paths outside work dir and /tmp."""
        if "\0" in path or not path:
            raise InvalidRequest(f"path {path!r} is empty or contains NUL")
        if path.startswith("/"):
            if path == self.workdir or path.startswith(self.workdir.rstrip("/") + "/"):
                root, rest = self.work_host, path[len(self.workdir):]
            elif path == "/tmp" or path.startswith("/tmp/"):
                root, rest = self.tmp_host, path[len("/tmp"):]
            else:
                raise InvalidRequest(f"path {path!r} is outside {self.workdir} and /tmp: only those are writable")
        else:
            root, rest = self.work_host, path
        parts = [p for p in rest.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise InvalidRequest(f"path {path!r} contains '..'")
        if not parts:
            raise InvalidRequest(f"path {path!r} names a directory, not a file")
        return root, parts


def _open_parent(root: str, parts: list[str], create: bool, uid: int, gid: int) -> int:
    """A descriptor of the directory holding ``parts[-1]``, walking without following symlinks."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_files(roots: Roots, files: list[api.FileData], uid: int, gid: int) -> int:
    """Write ``files`` (creating parent directories), owned by the sandbox user. Returns the bytes written."""
    total = 0
    for f in files:
        root, parts = roots.split(f.path)
        try:
            dfd = _open_parent(root, parts, True, uid, gid)
            try:
                fd = os.open(
                    parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                    0o600, dir_fd=dfd,
                )
            finally:
                os.close(dfd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise InvalidRequest(f"{f.path} exists and is not a regular file")
                os.fchown(fd, uid, gid)
                os.fchmod(fd, f.mode)
                view = memoryview(f.data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LimitReached(f"cannot write {f.path}: the sandbox's disk or inode quota is full "
                                   "(limits.disk_mb, limits.inodes)") from None
            raise InvalidRequest(f"cannot write {f.path}: {e.strerror} (symlinks are not followed)") from None
        total += len(f.data)
    return total


def read_file(roots: Roots, path: str, max_bytes: int) -> api.FileContent | api.FileError:
    """Read up to ``max_bytes`` of one file; errors are returned, not raised (other files still count)."""
    try:
        root, parts = roots.split(path)
    except InvalidRequest as e:
        return api.FileError(path=path, error=str(e))
    try:
        dfd = _open_parent(root, parts, False, 0, 0)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return api.FileError(path=path, error="not a regular file")
            chunks = []
            left = max_bytes
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
    except OSError as e:
        reason = "a symlink (not followed)" if e.errno == errno.ELOOP else e.strerror
        return api.FileError(path=path, error=f"cannot read: {reason}")
    return api.FileContent(path=path, data=data, size=st.st_size, truncated=st.st_size > len(data))
